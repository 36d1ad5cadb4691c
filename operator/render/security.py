"""Security parts of the rendered children: the API key from a Secret, its rotation hash, the NetworkPolicy.

Pure like render.py. The API key never appears in the CR, the Deployment or the pod's command line: the pod
reads it from the Secret through `env.valueFrom.secretKeyRef` (`KVSERVE_API_KEY`, which `kvserve serve` reads
when `--api-key` is absent). The Secret's value does not change the pod spec, so on its own a rotation would
never reach running pods; the operator therefore reads the Secret and writes a digest of it into a pod
template annotation, and a changed digest rolls the Deployment like any other template change.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any

from kvserve.operator.labels import OWNER_LABEL, engine_labels, engine_pod_selector
from kvserve.operator.render import kv_events as render_kv_events
from kvserve.operator.spec import Resolved
from kvserve.operator.spec_model import InferenceServiceSpec, SecretKeyRef

API_KEY_ENV = "KVSERVE_API_KEY"  # cli/serve.py reads it when --api-key is not given
API_KEY_HASH_ANNOTATION = "serving.kvserve.dev/api-key-hash"
# Prometheus usually runs in a namespace called "monitoring"; kubernetes.io/metadata.name is set by the API
# server on every namespace (>= 1.22), so it selects a namespace by name without any labelling by hand.
DEFAULT_METRICS_NAMESPACE_SELECTOR = {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
# The operator's own namespace, from the downward API (the chart's operator Deployment sets it; leader election
# keeps its Lease there too). The operator scrapes every engine pod's /metrics for PlanDrift, so the engine
# NetworkPolicy admits the operator's pods (the chart's component label) from there, on the metrics port.
OPERATOR_NAMESPACE_ENV = "POD_NAMESPACE"
OPERATOR_POD_LABELS = {"app.kubernetes.io/component": "operator"}  # charts/kvserve: kvserve.selectorLabels


def pod_security_context() -> dict[str, Any]:
    """The pod-level securityContext of every pod the operator renders (Pod Security "restricted"): a fresh dict
    each call, since callers may add to it."""
    return {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "fsGroup": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def api_key_ref(spec: InferenceServiceSpec) -> SecretKeyRef | None:
    """spec.auth.apiKeySecretRef ({name, key}) or None when the service is unauthenticated."""
    return spec.auth.api_key_secret_ref if spec.auth is not None else None


def api_key_env(spec: InferenceServiceSpec) -> list[dict]:
    """The container env entries that hand the API key to a kvserve process (engine or router)."""
    ref = api_key_ref(spec)
    if ref is None:
        return []
    return [{"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]


def pull_secrets(spec: InferenceServiceSpec) -> list[dict]:
    """spec.imagePullSecrets as the pod spec's [{name}] (the registry credentials the kubelet pulls with)."""
    return [s.model_dump(by_alias=True) for s in spec.image_pull_secrets or []]


def secret_digest(secret: dict | None, key: str) -> str | None:
    """A short digest of one Secret value, for the rotation annotation; None when the Secret or key is missing.

    The Secret's uid salts the hash, so the annotation (readable by anyone who can read Deployments) cannot be
    matched against a precomputed table of common keys. It changes whenever the value changes.
    """
    data = (secret or {}).get("data") or {}
    if key not in data:
        return None
    uid = (secret.get("metadata") or {}).get("uid", "")
    return hashlib.sha256(f"{uid}\0{key}\0{data[key]}".encode()).hexdigest()[:16]


def _uses_api_key(template: dict) -> bool:
    containers = (template.get("spec") or {}).get("containers") or []
    return any(env.get("name") == API_KEY_ENV and "valueFrom" in env for c in containers for env in c.get("env") or [])


def _with_annotation(template: dict, digest: str) -> dict:
    meta = template.get("metadata") or {}
    return {
        **template,
        "metadata": {**meta, "annotations": {**(meta.get("annotations") or {}), API_KEY_HASH_ANNOTATION: digest}},
    }


def with_api_key_hash(objs: list[dict], digest: str | None) -> list[dict]:
    """Copies of `objs` whose pod templates that read the API key carry `digest` (unchanged when None): a
    Deployment's template, and a LeaderWorkerSet's leader template (its workers serve no API)."""
    if digest is None:
        return objs
    out = []
    for obj in objs:
        spec = obj.get("spec") or {}
        template = spec.get("template")
        group = spec.get("leaderWorkerTemplate")
        if template is not None and _uses_api_key(template):
            obj = {**obj, "spec": {**spec, "template": _with_annotation(template, digest)}}
        elif group is not None and _uses_api_key(group.get("leaderTemplate") or {}):
            group = {**group, "leaderTemplate": _with_annotation(group["leaderTemplate"], digest)}
            obj = {**obj, "spec": {**spec, "leaderWorkerTemplate": group}}
        out.append(obj)
    return out


def operator_peers(environ: Mapping[str, str]) -> list[dict[str, Any]]:
    """The operator's pods in its own namespace ($POD_NAMESPACE), as a NetworkPolicy peer; none when the
    operator does not know its namespace (run outside a pod: its scrapes do not come from a pod then)."""
    namespace = (environ.get(OPERATOR_NAMESPACE_ENV) or "").strip()
    if not namespace:
        return []
    return [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)},
        }
    ]


def network_policy(resolved: Resolved, name: str, namespace: str, extra_ingress: tuple[dict, ...] = ()) -> dict:
    """Ingress to the engine pods: the API port from this InferenceService's own pods (the router), pods of
    the same namespace (allowSameNamespace) and the listed peers; the same port for /metrics from the
    monitoring namespace and from the operator's pods in its namespace (`operator_peers`: its PlanDrift
    scrapes). NetworkPolicy is L4: the metrics peers can also open /v1, which the API key still guards.
    `extra_ingress`: more rules (a multi-pod replica's members reaching each other, render_multinode)."""
    policy, port = resolved.spec.network_policy, resolved.spec.port
    api_peers: list[dict[str, Any]] = (
        [{"podSelector": {}}]
        if policy.allow_same_namespace
        else [{"podSelector": {"matchLabels": {OWNER_LABEL: name}}}]
    )
    api_peers += [peer.model_dump(by_alias=True, exclude_none=True) for peer in policy.from_ or []]
    metrics_peers: list[dict[str, Any]] = [
        {"namespaceSelector": policy.metrics_namespace_selector or DEFAULT_METRICS_NAMESPACE_SELECTOR},
        *operator_peers(os.environ),
    ]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": namespace, "labels": engine_labels(name)},
        "spec": {
            "podSelector": {"matchLabels": engine_pod_selector(name)},
            "policyTypes": ["Ingress"],  # egress stays open: DNS, and model downloads where configured
            "ingress": [
                {"from": api_peers, "ports": [{"protocol": "TCP", "port": port}]},
                {"from": metrics_peers, "ports": [{"protocol": "TCP", "port": port}]},
                *render_kv_events.network_policy_ingress(resolved.spec, name),  # the routers' event subscriptions
                *extra_ingress,
            ],
        },
    }

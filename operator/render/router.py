"""Pure renderer for `spec.router`: the `kvserve router` in front of an InferenceService's replicas.

When spec.router.enabled, each InferenceService gets a router Deployment + Service named `<name>-router`,
a ServiceAccount with a Role (and RoleBinding) that can only read EndpointSlices in its namespace, and a
PodDisruptionBudget. The router finds the engine pods through the engine Service's EndpointSlices, reads
the tokenizer from the same model source as the engine, and `status.url` then points at the router Service.
Router pods carry their own `app.kubernetes.io/name`, so the engine Service and the /scale selector never
select them. With spec.router.replicas >= 2 the routers run active-active on the engines' KV events
(render/kv_events.py adds the subscription flags here) and their pods spread over nodes.
"""

from __future__ import annotations

from typing import Any

from kvserve.operator.labels import router_labels, router_selector
from kvserve.operator.render import kv_events as render_kv_events
from kvserve.operator.render import security as render_security
from kvserve.operator.spec import Resolved, scales_to_zero
from kvserve.operator.spec_model import InferenceServiceSpec

SUFFIX = "-router"
# Kinds only the router has (its Deployment, Service and PDB share kinds with the engine's children).
ROUTER_ONLY_KINDS = ("ServiceAccount", "Role", "RoleBinding")
DEFAULT_RESOURCES = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}


def router_name(name: str) -> str:
    return name + SUFFIX


def enabled(spec: InferenceServiceSpec) -> bool:
    return spec.router.enabled


def url_service_name(spec: InferenceServiceSpec, name: str) -> str:
    """The Service clients should use: the router's when there is one."""
    return router_name(name) if enabled(spec) else name


def child_keys(name: str, spec: InferenceServiceSpec, previous_status: dict) -> list[tuple[str, str]]:
    """(kind, name) of the router objects the operator must look at: all of them while the router is enabled
    or while the last status still points at it (so a router switched off is pruned); none otherwise, which
    spares InferenceServices without a router six GETs per reconcile."""
    rname = router_name(name)
    url = (previous_status or {}).get("url") or ""
    if not enabled(spec) and not url.startswith(f"http://{rname}."):
        return []
    return [(kind, rname) for kind in ("Deployment", "Service", "PodDisruptionBudget", *ROUTER_ONLY_KINDS)]


def router_args(resolved: Resolved, name: str, namespace: str, model_dir: str) -> list[str]:
    spec = resolved.spec
    return [
        "kvserve",
        "router",
        "--service",
        name,
        "--namespace",
        namespace,
        "--port-name",
        "http",
        "--tokenizer",
        model_dir,
        "--host",
        "0.0.0.0",
        "--port",
        str(spec.port),
        # Fallbacks only: replicas report block size and KV capacity on /metrics.
        "--block-size",
        str(spec.engine.block_size),
        "--default-capacity-tokens",
        str(max(1, resolved.plan.kv_tokens)),
        *hold_args(spec),
        # spec.router.kvEvents: subscribe to every engine pod's KV events (issue 40)
        *render_kv_events.router_args(spec),
    ]


DEFAULT_MAX_HELD_REQUESTS = 256
DEFAULT_HOLD_TIMEOUT_SECONDS = 600  # a GPU cold start: node, image pull, weight load; the OpenAI SDK waits 600 s


def hold_args(spec: InferenceServiceSpec) -> list[str]:
    """Scale from zero: the router holds requests while no replica is ready (and is ready itself at zero
    replicas, so the Service takes them). Only with autoscaling.minReplicas 0, where that is the design."""
    if not scales_to_zero(spec):
        return []
    router = spec.router
    held = router.max_held_requests if router.max_held_requests is not None else DEFAULT_MAX_HELD_REQUESTS
    timeout = router.hold_timeout_seconds if router.hold_timeout_seconds is not None else DEFAULT_HOLD_TIMEOUT_SECONDS
    return ["--max-held-requests", str(held), "--hold-timeout", str(timeout)]


def render(
    resolved: Resolved,
    name: str,
    namespace: str,
    model_source: tuple[list[dict], list[dict], str],
    init_containers: list[dict] | None = None,
) -> list[dict]:
    """`model_source`: (volumes, read-only mounts, tokenizer directory); `init_containers`: what fills them
    for a downloaded model (render_model.router_model_source)."""
    spec = resolved.spec
    if not enabled(spec):
        return []
    router = spec.router
    rname = router_name(name)
    labels = router_labels(name)
    meta = {"name": rname, "namespace": namespace, "labels": labels}
    volumes, mounts, model_dir = model_source
    port = spec.port
    probe: dict[str, Any] = {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": 5,
        "timeoutSeconds": 3,
        "failureThreshold": 3,
    }
    container = {
        "name": "router",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": router_args(resolved, name, namespace, model_dir),
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        # The engines' API key (spec.auth), so the router can read their /v1/models for adapter affinity; it
        # is used for that poll only, never added to proxied requests (clients still send their own).
        "env": [{"name": "HOME", "value": "/tmp"}, *render_security.api_key_env(spec)],
        "resources": (router.resources.model_dump(exclude_none=True) if router.resources else None)
        or DEFAULT_RESOURCES,
        "volumeMounts": mounts + [{"name": "tmp", "mountPath": "/tmp"}],
        # Ready once it knows at least one routable replica; alive as long as it accepts connections (a
        # router with no replicas must not be restarted for it).
        "readinessProbe": probe,
        "livenessProbe": {
            "tcpSocket": {"port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 3,
            "failureThreshold": 6,
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": rname,
        **({"initContainers": init_containers} if init_containers else {}),
        "containers": [container],
        "volumes": volumes + [{"name": "tmp", "emptyDir": {}}],
        "securityContext": render_security.pod_security_context(),
        "terminationGracePeriodSeconds": 30,
    }
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = render_security.pull_secrets(spec)
    selector = router_selector(name)
    if router.replicas >= 2:  # active-active: a node's loss or drain should not take every router at once
        pod_spec["topologySpreadConstraints"] = [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": selector},
            }
        ]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": [
                {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": rname},
            "subjects": [{"kind": "ServiceAccount", "name": rname, "namespace": namespace}],
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta,
            "spec": {
                "replicas": router.replicas,
                "revisionHistoryLimit": 3,
                "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                "selector": {"matchLabels": selector},
                "template": {
                    "metadata": {
                        "labels": labels,
                        "annotations": {
                            "prometheus.io/scrape": "true",
                            "prometheus.io/port": str(port),
                            "prometheus.io/path": "/metrics",
                        },
                    },
                    "spec": pod_spec,
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta,
            "spec": {
                "type": "ClusterIP",
                "selector": selector,
                "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
            },
        },
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": meta,
            "spec": {
                "maxUnavailable": 1,
                "selector": {"matchLabels": selector},
                "unhealthyPodEvictionPolicy": "AlwaysAllow",
            },
        },
    ]

"""Pure renderer of a replica that spans several pods (issue 28): one LeaderWorkerSet group per replica.

A LeaderWorkerSet (leaderworkerset.x-k8s.io/v1, github.com/kubernetes-sigs/lws) runs `size` pods per group:
the leader (worker index 0) and size - 1 workers, with LWS_LEADER_ADDRESS (the leader's stable DNS name,
<lws>-<group>.<lws>.<namespace>) and LWS_WORKER_INDEX injected into every container. Each pod is one pipeline
stage of TP GPUs (kvserve serve --nnodes size --node-rank k, docs/multinode.md):
- the leader runs the API server, the scheduler and its stage's ranks; it alone has the HTTP port, the
  probes, the metrics annotations, the API key and the Service;
- a worker runs `--headless`: its ranks only, which connect back to the leader's executor on
  master_port + 1 (HMAC on $KVSERVE_MULTINODE_AUTHKEY, from a Secret) and rendezvous with torch.distributed
  on master_port. It has no HTTP server, so no HTTP probe: its readiness is the leader's /health, which
  answers 200 only once every rank of every node has joined and 503 as soon as one dies; a worker whose rank
  or leader dies exits 1 (the process is its liveness), and RecreateGroupOnPodRestart then recreates the
  whole group, which is what a pipeline with a missing stage needs.
Ports between a group's pods: master_port (TCPStore), master_port + 1 (the executor's control connections),
and the ports gloo/NCCL bind with port 0, i.e. from the pod's net.ipv4.ip_local_port_range. The pods pin
that range with a (safe, namespaced) sysctl so the NetworkPolicy can name it instead of opening every port.

The LWS is named <name>-lws, not <name>: the LWS controller creates a headless Service named after the LWS
for its pods' DNS (the subdomain), and <name> is the API Service clients and the router use.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from kvserve.operator.labels import engine_labels
from kvserve.operator.render import security as render_security
from kvserve.operator.spec import Resolved, SpecError
from kvserve.operator.spec_model import InferenceServiceSpec, SecretKeyRef
from kvserve.runtime import engine_args

API_VERSION = "leaderworkerset.x-k8s.io/v1"
KIND = "LeaderWorkerSet"
SUFFIX = "-lws"
ROLE_LABEL = "serving.kvserve.dev/role"  # leader | worker: the Service, InferencePool and KEDA select leaders
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"  # set by the LWS controller on every pod of the set
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"  # "0" on leaders
LEADER_ADDRESS = "$(LWS_LEADER_ADDRESS)"  # expanded by the kubelet from the env the LWS controller injects
WORKER_INDEX = "$(LWS_WORKER_INDEX)"
MASTER_PORT = engine_args.default("master_port")  # torch.distributed's TCPStore on the leader
CONTROL_PORT = MASTER_PORT + 1  # the leader executor's listener for the other nodes' ranks
# Linux's default ip_local_port_range: where gloo's and NCCL's port-0 listeners land. Pinned per pod below.
EPHEMERAL_PORTS = (32768, 60999)
PORT_RANGE_SYSCTL = {"name": "net.ipv4.ip_local_port_range", "value": f"{EPHEMERAL_PORTS[0]} {EPHEMERAL_PORTS[1]}"}
# Mirrors kvserve.runtime.executor.multinode.AUTHKEY_ENV (tests/operator/test_render_multinode.py keeps them equal).
AUTHKEY_ENV = "KVSERVE_MULTINODE_AUTHKEY"
AUTHKEY_SECRET_SUFFIX = "-multinode"
AUTHKEY_KEY = "authkey"
# StatefulSet pods carry controller-revision-hash=<statefulset>-<10 chars>, a label value of at most 63
# characters; LWS names its StatefulSets <lws> (leaders) and <lws>-<group> (workers): 45 leaves 6 digits of groups.
MAX_LWS_NAME = 45
_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def lws_name(name: str) -> str:
    return name + SUFFIX


def check_name(name: str) -> None:
    """The LWS webhook's rule (the name is its headless Service's: a DNS-1035 label) and the StatefulSet
    label limit, as a SpecError naming metadata.name instead of a refused create."""
    lws = lws_name(name)
    if not _DNS1035.fullmatch(lws) or len(lws) > MAX_LWS_NAME:
        raise SpecError(
            "InvalidName",
            f"metadata.name {name!r}: a replica spanning several pods is a LeaderWorkerSet named {lws!r}, which "
            f"must be a DNS-1035 label (lowercase letters, digits and '-', starting with a letter) of at most "
            f"{MAX_LWS_NAME} characters: use a name of at most {MAX_LWS_NAME - len(SUFFIX)} characters",
        )


def authkey_ref(spec: InferenceServiceSpec) -> SecretKeyRef | None:
    """The group's shared key: spec.parallelism.authKeySecretRef; None: the operator's own Secret."""
    return spec.parallelism.auth_key_secret_ref


def owns_authkey(spec: InferenceServiceSpec) -> bool:
    return authkey_ref(spec) is None


def authkey_secret_name(name: str) -> str:
    return name + AUTHKEY_SECRET_SUFFIX


def authkey_secret(name: str, namespace: str) -> dict:
    """The operator's Secret, without its value: the operator fills `stringData` with a random key when it
    creates the Secret (with_generated_key) and never rewrites it, so rendering stays deterministic."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": authkey_secret_name(name), "namespace": namespace, "labels": engine_labels(name)},
        "type": "Opaque",
    }


def with_generated_key(secret: dict, key: str) -> dict:
    return {**secret, "stringData": {AUTHKEY_KEY: key}}


def _authkey_env(spec: InferenceServiceSpec, name: str) -> dict:
    ref = authkey_ref(spec) or SecretKeyRef(name=authkey_secret_name(name), key=AUTHKEY_KEY)
    return {"name": AUTHKEY_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


def node_settings(resolved: Resolved, node_rank: str) -> dict[str, Any]:
    """The EngineArgs values that make a pod one stage of the group (runtime_args renders them as flags)."""
    layout = resolved.layout
    assert layout is not None and layout.multinode
    return {
        "pipeline_parallel_size": layout.pipeline_parallel_size,
        "nnodes": layout.nodes,
        "node_rank": node_rank,
        "master_addr": LEADER_ADDRESS,
        "master_port": MASTER_PORT,
    }


def _member(template: dict, role: str, env: list[dict]) -> dict:
    out = copy.deepcopy(template)
    out["metadata"]["labels"][ROLE_LABEL] = role
    (container,) = out["spec"]["containers"]
    container["env"] = container["env"] + env
    out["spec"]["securityContext"] = {**out["spec"]["securityContext"], "sysctls": [dict(PORT_RANGE_SYSCTL)]}
    return out


def leader_template(resolved: Resolved, name: str, base: dict) -> dict:
    """`base`: render.pod_template with the leader's node settings (node rank 0)."""
    out = _member(base, "leader", [_authkey_env(resolved.spec, name)])
    (container,) = out["spec"]["containers"]
    container["ports"] = container["ports"] + [
        {"name": "rendezvous", "containerPort": MASTER_PORT, "protocol": "TCP"},
        {"name": "control", "containerPort": CONTROL_PORT, "protocol": "TCP"},
    ]
    return out


def worker_template(resolved: Resolved, name: str, base: dict) -> dict:
    """`base`: render.pod_template with the workers' node settings (node rank $(LWS_WORKER_INDEX)). No API
    server: no HTTP port, probes, preStop sleep, metrics annotations or API key; `--headless`."""
    out = _member(base, "worker", [_authkey_env(resolved.spec, name)])
    out["metadata"].pop("annotations", None)
    (container,) = out["spec"]["containers"]
    container["command"] = container["command"] + ["--headless"]
    container["env"] = [e for e in container["env"] if e["name"] != render_security.API_KEY_ENV]
    for key in ("ports", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle"):
        container.pop(key, None)
    return out


def leader_worker_set(resolved: Resolved, name: str, namespace: str, leader: dict, worker: dict) -> dict:
    spec, layout = resolved.spec, resolved.layout
    assert layout is not None
    lws_spec: dict[str, Any] = {}
    if not spec.autoscaling.enabled:
        # With autoscaling the HPA (or KEDA) owns spec.replicas through the LWS's /scale: not rendered, so
        # the operator's compare-then-patch never fights it (the LWS defaults it to 1 at creation).
        lws_spec["replicas"] = spec.replicas
    lws_spec.update(
        {
            # Workers start with the leader; LeaderReady would deadlock: the leader is Ready only once they joined.
            "startupPolicy": "LeaderCreated",
            # As the Deployment: one group more during a rollout, never one fewer than asked.
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "leaderWorkerTemplate": {
                "size": layout.nodes,
                # A pipeline with a lost stage cannot serve: any member's restart recreates the whole group.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        }
    )
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": lws_name(name), "namespace": namespace, "labels": engine_labels(name)},
        "spec": lws_spec,
    }


def scale_target(name: str) -> dict:
    """The HPA's / KEDA's target: the LWS's /scale (status.hpaPodSelector selects the leaders only, so the
    per-pod queue metric is averaged over the pods that serve, and replicas count groups)."""
    return {"apiVersion": API_VERSION, "kind": KIND, "name": lws_name(name)}


def leader_pods_regex(name: str) -> str:
    """PromQL regex for the leader pods (<lws>-<group>); workers are <lws>-<group>-<index> and export nothing."""
    assert re.fullmatch(r"[a-z0-9.-]+", name), name
    return lws_name(name).replace(".", "[.]") + "-[0-9]+"


def group_ingress(name: str, selector: dict[str, str]) -> dict:
    """NetworkPolicy ingress rule: the pods of this InferenceService's groups reach each other on the
    rendezvous and control ports and the pinned ephemeral range (gloo/NCCL data connections)."""
    return {
        "from": [{"podSelector": {"matchLabels": dict(selector)}}],
        "ports": [
            {"protocol": "TCP", "port": MASTER_PORT},
            {"protocol": "TCP", "port": CONTROL_PORT},
            {"protocol": "TCP", "port": EPHEMERAL_PORTS[0], "endPort": EPHEMERAL_PORTS[1]},
        ],
    }

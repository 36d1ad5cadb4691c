"""Pure renderer of a disaggregated InferenceService (spec.disaggregation, issue 42): a prefill and a decode pool.

llm-d's shape (docs/operator.md, "Disaggregated prefill/decode"): the engine pods of each pool carry
`llm-d.ai/role: prefill|decode` and run with `--kv-transfer-config '{"kv_connector":"NixlConnector",
"kv_role":"kv_producer"|"kv_consumer"}'`; the router, in P/D mode, reads the role from that label, sends a long
prompt to a prefill pod and the request to a decode pod, which pulls the prompt's KV from the prefill pod.

Per pool `<name>-prefill` / `<name>-decode`:
- the workload: a Deployment, or a LeaderWorkerSet `<name>-<role>-lws` when one replica of the pool spans several
  pods (its plan, from the one planner at the pool's own TP: operator/pools.py), built by the aggregated path's
  own functions (render.pod_template, render_multinode) and then given the pool's name, labels and selector;
- an HPA on the pool's own signal (present when spec.disaggregation.<role>.autoscaling is): prefill on
  vllm:num_requests_waiting per pod, targeting its own Deployment / LWS; decode on vllm:num_requests_running and
  vllm:kv_cache_usage_perc per pod, targeting the InferenceService's /scale (spec.replicas is the decode pool's
  replica count, and status.selector selects the decode pods that serve), or the decode LWS's /scale;
- a PodDisruptionBudget over the pool's pods.
Shared: the API Service `<name>` (every pod that serves HTTP, both roles: the router's --service), the router
(P/D flags from router_pd_args, its Role may also read pods for their role label) and one NetworkPolicy, which
adds the transfer port and the pinned ephemeral range (UCX's TCP data connections) between this service's pods.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

from kvserve.operator.labels import engine_labels, engine_pod_selector, engine_selector
from kvserve.operator.pools import Pool, Pools
from kvserve.operator.render import model as render_model
from kvserve.operator.render import multinode as render_multinode
from kvserve.operator.render import router as render_router
from kvserve.operator.render import scaling as render_scaling
from kvserve.operator.render import security as render_security
from kvserve.operator.spec import API_VERSION, KIND, Resolved
from kvserve.operator.spec_model import AutoscalingSpec, InferenceServiceSpec

ROLE_LABEL = "llm-d.ai/role"  # llm-d's pool label: prefill | decode (the router reads it in P/D mode)
# On the pods that serve the API (a Deployment's, an LWS's leaders): what the Service and /scale select.
API_LABEL = "serving.kvserve.dev/api"
SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"  # the address a decode pod's handshake reaches
SIDE_CHANNEL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
TRANSFER_PORT_NAME = "kv-transfer"
RUNNING_METRIC = "vllm_num_requests_running"  # prometheus-adapter's names for vllm:num_requests_running, ...
KV_USAGE_METRIC = "vllm_kv_cache_usage_perc"


@dataclasses.dataclass(frozen=True)
class EngineParts:
    """The aggregated path's renderers (operator/render/__init__.py), handed in by its render(): that module
    dispatches here, so importing it back would be an import cycle."""

    deployment: Callable[..., dict]
    pod_template: Callable[..., dict]
    service: Callable[..., dict]
    disruption_budget: Callable[..., dict]
    default_behavior: dict
    queue_metric: str  # prometheus-adapter's name for vllm:num_requests_waiting


def pool_name(name: str, role: str) -> str:
    return f"{name}-{role}"


def pool_selector(name: str, role: str) -> dict[str, str]:
    """Every pod of one pool (a Deployment's selector, the PDB's)."""
    return {**engine_selector(name), ROLE_LABEL: role}


def pool_labels(name: str, role: str) -> dict[str, str]:
    """The engine's labels (owner label included: child events reach this InferenceService) plus the role."""
    return {**engine_labels(name), ROLE_LABEL: role}


def serving_selector(name: str, role: str | None = None) -> dict[str, str]:
    """The pods that serve the API, of one pool or (role None) of both."""
    return {**engine_pod_selector(name), API_LABEL: "true", **({ROLE_LABEL: role} if role else {})}


def scale_selector(name: str) -> str:
    """status.selector (the /scale subresource's) with pools: the decode pods that serve, as a selector string."""
    return ",".join(f"{k}={v}" for k, v in sorted(serving_selector(name, "decode").items()))


def router_pd_args(pools: Pools) -> list[str]:
    """`kvserve router` flags for P/D mode, in one place: the router (already given --service) reads each
    pod's role from ROLE_LABEL and picks a prefill and a decode pod per request (docs/router.md, "Router P/D
    mode"); P/D mode is on as soon as a pod has the prefill role."""
    return ["--role-label", ROLE_LABEL]


def pool_resolved(resolved: Resolved, pool: Pool) -> Resolved:
    """`resolved` as one pool sees it: its TP, plan, layout, replicas, resources and autoscaling switch, so the
    aggregated path's functions render the pool's pods (KV budget, GPUs, CPU/memory requests) unchanged."""
    spec: InferenceServiceSpec = resolved.spec
    pool_spec = spec.model_copy(
        update={
            "gpu": spec.gpu.model_copy(update={"tensor_parallel_size": pool.tensor_parallel_size}),
            "replicas": pool.replicas,
            "resources": pool.resources or spec.resources,
            "autoscaling": AutoscalingSpec(enabled=pool.autoscaling is not None),
        }
    )
    return dataclasses.replace(
        resolved, spec=pool_spec, plan=pool.plan, plan_input=pool.plan_input, layout=pool.layout, pools=None
    )


def _with_transfer(template: dict, pools: Pools, pool: Pool, name: str) -> dict:
    """The pool's pod: role label, --kv-transfer-config, the side channel's address and port, the pinned
    ephemeral port range (UCX over TCP opens its data connections there) and spreading within the pool."""
    out = copy.deepcopy(template)
    out["metadata"]["labels"][ROLE_LABEL] = pool.role
    pod = out["spec"]
    (container,) = pod["containers"]
    container["command"] = container["command"] + ["--kv-transfer-config", pools.kv_transfer_config(pool)]
    container["env"] = container["env"] + [
        {"name": SIDE_CHANNEL_HOST_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": SIDE_CHANNEL_PORT_ENV, "value": str(pools.transfer_port)},
    ]
    pod["securityContext"] = {**pod["securityContext"], "sysctls": [dict(render_multinode.PORT_RANGE_SYSCTL)]}
    for constraint in pod.get("topologySpreadConstraints") or []:
        constraint["labelSelector"] = {"matchLabels": pool_selector(name, pool.role)}
    return out


def _transfer_port(template: dict, pools: Pools) -> dict:
    (container,) = template["spec"]["containers"]
    port = {"name": TRANSFER_PORT_NAME, "containerPort": pools.transfer_port, "protocol": "TCP"}
    container["ports"] = container.get("ports", []) + [port]
    return template


def _serves_api(template: dict) -> dict:
    template["metadata"]["labels"][API_LABEL] = "true"
    return template


def pool_workload(
    parts: EngineParts, resolved: Resolved, pools: Pools, pool: Pool, name: str, namespace: str
) -> list[dict]:
    """The pool's Deployment, or its LeaderWorkerSet (whose group key Secret the caller renders once)."""
    pr = pool_resolved(resolved, pool)
    pname, role = pool_name(name, pool.role), pool.role
    if not pool.layout.multinode:
        dep = parts.deployment(pr, name, namespace)
        dep["metadata"] = {"name": pname, "namespace": namespace, "labels": pool_labels(name, role)}
        dep["spec"]["selector"] = {"matchLabels": pool_selector(name, role)}
        template = _with_transfer(dep["spec"]["template"], pools, pool, name)
        dep["spec"]["template"] = _serves_api(_transfer_port(template, pools))
        if role == "prefill" and pool.autoscaling is not None:
            # The prefill HPA owns the Deployment's replicas (its own /scale): not rendered, so the operator's
            # compare-then-patch never fights it. The decode pool's HPA scales spec.replicas instead.
            del dep["spec"]["replicas"]
        return [dep]
    render_multinode.check_name(pname)
    leader = render_multinode.leader_template(
        pr,
        name,
        _with_transfer(
            parts.pod_template(pr, name, render_multinode.node_settings(pr, "0")),
            pools,
            pool,
            name,
        ),
    )
    worker = render_multinode.worker_template(
        pr,
        name,
        _with_transfer(
            parts.pod_template(pr, name, render_multinode.node_settings(pr, render_multinode.WORKER_INDEX)),
            pools,
            pool,
            name,
        ),
    )
    lws = render_multinode.leader_worker_set(
        pr, pname, namespace, _serves_api(_transfer_port(leader, pools)), _transfer_port(worker, pools)
    )
    lws["metadata"]["labels"] = pool_labels(name, role)
    return [lws]


def _scale_target(pool: Pool, name: str) -> dict:
    pname = pool_name(name, pool.role)
    if pool.layout.multinode:
        return render_multinode.scale_target(pname)
    if pool.role == "decode":
        return {"apiVersion": API_VERSION, "kind": KIND, "name": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": pname}


def _pods_metric(metric: str, average: str) -> dict:
    return {
        "type": "Pods",
        "pods": {"metric": {"name": metric}, "target": {"type": "AverageValue", "averageValue": average}},
    }


def pool_autoscaler(parts: EngineParts, resolved: Resolved, pool: Pool, name: str, namespace: str) -> dict | None:
    bounds = pool.autoscaling
    if bounds is None:
        return None
    if pool.role == "prefill":  # its own queue: prompts waiting for a prefill slot
        metrics = [_pods_metric(parts.queue_metric, str(bounds["targetWaitingRequests"]))]
        behavior = resolved.spec.disaggregation.prefill.autoscaling.behavior
    else:  # streams in flight and the KV they hold (0..1 per pod, so a percent as milli-units)
        metrics = [
            _pods_metric(RUNNING_METRIC, str(bounds["targetRunningRequests"])),
            _pods_metric(KV_USAGE_METRIC, f"{bounds['targetKVCacheUsagePercent'] * 10}m"),
        ]
        behavior = resolved.spec.disaggregation.decode.autoscaling.behavior
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {
            "name": pool_name(name, pool.role),
            "namespace": namespace,
            "labels": pool_labels(name, pool.role),
        },
        "spec": {
            "scaleTargetRef": _scale_target(pool, name),
            "minReplicas": bounds["minReplicas"],
            "maxReplicas": bounds["maxReplicas"],
            "metrics": metrics,
            "behavior": behavior or parts.default_behavior,
        },
    }


def pool_disruption_budget(parts: EngineParts, resolved: Resolved, pool: Pool, name: str, namespace: str) -> dict:
    pdb = parts.disruption_budget(resolved, name, namespace)
    pdb["metadata"] = {
        "name": pool_name(name, pool.role),
        "namespace": namespace,
        "labels": pool_labels(name, pool.role),
    }
    pdb["spec"]["selector"] = {"matchLabels": pool_selector(name, pool.role)}
    return pdb


def transfer_ingress(name: str, pools: Pools) -> dict:
    """NetworkPolicy ingress: this service's engine pods reach each other's side-channel port (the decode pod's
    handshake with a prefill pod) and the pinned ephemeral range (UCX's TCP connections that move the KV)."""
    low, high = render_multinode.EPHEMERAL_PORTS
    return {
        "from": [{"podSelector": {"matchLabels": engine_pod_selector(name)}}],
        "ports": [
            {"protocol": "TCP", "port": pools.transfer_port},
            {"protocol": "TCP", "port": low, "endPort": high},
        ],
    }


def router_objects(resolved: Resolved, pools: Pools, name: str, namespace: str) -> list[dict]:
    """The router's objects (render_router) with the P/D flags, and read access to pods (their role label)."""
    *source, inits = render_model.router_model_source(resolved)
    objs = render_router.render(resolved, name, namespace, tuple(source), inits)
    for obj in objs:
        if obj["kind"] == "Deployment":
            (container,) = obj["spec"]["template"]["spec"]["containers"]
            container["command"] = container["command"] + router_pd_args(pools)
        elif obj["kind"] == "Role":
            obj["rules"] = obj["rules"] + [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
            ]
    return objs


def render(parts: EngineParts, resolved: Resolved, name: str, namespace: str) -> list[dict]:
    """Every child of a disaggregated InferenceService (resolved.pools set; the caller checked the plan fits)."""
    pools, spec = resolved.pools, resolved.spec
    assert pools is not None
    multinode = [p for p in pools if p.layout.multinode]
    objs: list[dict[str, Any]] = []
    if multinode and render_multinode.owns_authkey(spec):  # first: the pods read it at start (one for both pools)
        objs.append(render_multinode.authkey_secret(name, namespace))
    objs.append(parts.service(resolved, name, namespace, selector=serving_selector(name)))
    for pool in pools:
        hpa = pool_autoscaler(parts, resolved, pool, name, namespace)
        if hpa is not None:
            objs.append(hpa)
        if spec.pod_disruption_budget.enabled:
            objs.append(pool_disruption_budget(parts, resolved, pool, name, namespace))
    objs += router_objects(resolved, pools, name, namespace)
    if spec.network_policy.enabled:
        extra = [transfer_ingress(name, pools)]
        if multinode:
            extra.append(render_multinode.group_ingress(name, engine_pod_selector(name)))
        objs.append(render_security.network_policy(resolved, name, namespace, extra_ingress=tuple(extra)))
    # Deployments before the optional CRDs' kinds (LeaderWorkerSet, GIE): everything else is applied first.
    workloads = [obj for pool in pools for obj in pool_workload(parts, resolved, pools, pool, name, namespace)]
    objs += [w for w in workloads if w["kind"] == "Deployment"] + [w for w in workloads if w["kind"] != "Deployment"]
    pool = render_scaling.inference_pool(resolved, name, namespace, selector=serving_selector(name))
    if pool is not None:
        objs.append(pool)
    return objs


def workload_key(name: str, pool: Pool) -> tuple[str, str]:
    """(kind, name) of the pool's workload."""
    pname = pool_name(name, pool.role)
    if pool.layout.multinode:
        return render_multinode.KIND, render_multinode.lws_name(pname)
    return "Deployment", pname


def child_keys(name: str, spec: InferenceServiceSpec, previous_status: dict) -> list[tuple[str, str]]:
    """(kind, name) of the pool objects the operator must look at: all that a pool may have while
    spec.disaggregation is set or the last status still shows pools (so that switching it off prunes them)."""
    if spec.disaggregation is None and not (previous_status or {}).get("disaggregation"):
        return []
    keys: list[tuple[str, str]] = []
    for role in ("prefill", "decode"):
        pname = pool_name(name, role)
        keys += [
            ("Deployment", pname),
            (render_multinode.KIND, render_multinode.lws_name(pname)),
            ("HorizontalPodAutoscaler", pname),
            ("PodDisruptionBudget", pname),
        ]
    return keys + [("Secret", render_multinode.authkey_secret_name(name))]

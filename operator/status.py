"""Pure status: (plan, observed Deployment, previous status) -> the InferenceService's .status.

Condition timestamps move only when a condition's status flips, so recomputing the status of an unchanged
object yields an identical dict and the operator patches nothing.
"""

from __future__ import annotations

from typing import Any

from kvserve.operator.labels import selector_string
from kvserve.operator.pod_health import PodFailure
from kvserve.operator.pools import Pools
from kvserve.operator.render import service_url
from kvserve.operator.render.router import url_service_name
from kvserve.operator.spec_model import InferenceServiceSpec
from kvserve.runtime.planner.kv_plan import Plan

_PLAN_FIELDS = {
    "kvBytesPerToken": "kv_bytes_per_token",
    "kvBytesPerTokenPerGpu": "kv_bytes_per_token_per_gpu",
    "weightBytesPerGpu": "weight_bytes_per_gpu",
    "gpuMemoryBytes": "gpu_memory_bytes",
    "memoryBudgetBytesPerGpu": "memory_budget_bytes_per_gpu",
    "kvCacheBytesPerGpu": "kv_cache_bytes_per_gpu",
    "numBlocksPerGpu": "num_blocks_per_gpu",
    "kvTokens": "kv_tokens",
    "maxConcurrency": "max_concurrency",
    "maxModelLenFit": "max_model_len_fit",
}


def plan_status(plan: Plan) -> dict[str, int]:
    return {camel: getattr(plan, snake) for camel, snake in _PLAN_FIELDS.items()}


def _condition(
    ctype: str, ok: bool, reason: str, message: str, previous: dict[str, dict], now: str, generation: int | None
) -> dict[str, Any]:
    status = "True" if ok else "False"
    old = previous.get(ctype)
    since = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") else now
    cond = {"type": ctype, "status": status, "reason": reason, "message": message, "lastTransitionTime": since}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def _deployment_condition(deployment: dict | None, ctype: str) -> dict:
    for cond in ((deployment or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == ctype:
            return cond
    return {}


def compute_status(
    *,
    name: str,
    namespace: str,
    spec: InferenceServiceSpec,
    generation: int | None,
    plan: Plan | None,
    plan_reason: str,
    plan_message: str,
    deployment: dict | None,
    previous: dict | None,
    now: str,
    pod_failure: PodFailure | None = None,
    conflicts: tuple[str, ...] = (),
    model_ready: tuple[bool, str, str] | None = None,
    workload_kind: str = "Deployment",
    parallelism: dict | None = None,
    missing_crds: tuple[str, ...] = (),
    adapters: tuple[int, int] | None = None,
    plan_drift: tuple[bool, str, str] | None = None,
    pools: dict | None = None,
    selector: str | None = None,
) -> dict[str, Any]:
    """`plan` is None when the spec could not be planned at all (unknown model/GPU); `spec` has defaults.

    `conflicts` labels children (kind, or kind/name) whose object this InferenceService does not own: nothing is
    adopted or written then, so the status must not report someone else's Deployment as ours (no Ready, no url).
    `pod_failure` is pod_health.diagnose() of the InferenceService's pods; `model_ready` pod_health.model_ready()
    (None: the ModelReady condition is left out, for callers that know nothing of the source).
    `deployment` is the workload, of `workload_kind`: the Deployment, or for replicas of several pods the
    LeaderWorkerSet (whose status has the same replicas/readyReplicas/updatedReplicas/observedGeneration, in
    groups); `parallelism` its layout for status.parallelism. `missing_crds`: "could not create" messages for
    kinds this cluster does not serve (an optional CRD is not installed): Degraded, with the message.
    `adapters`: (served by every ready pod, in spec.adapters) -- status.adapters "ready/total" and the
    AdaptersReady condition (AdapterLoadFailed from `pod_failure`); None or a total of 0 leaves both out.
    `plan_drift`: the PlanDrift condition (operator/drift.py: pods measured against spec.slo's plan); None
    leaves it out (no spec.slo).
    `pools`: spec.disaggregation's status.disaggregation (pools_status); `deployment` is then the decode pool's
    workload and `selector` its serving pods' (the /scale subresource's), and Ready needs the prefill pool too.
    """
    if conflicts:
        deployment, pod_failure = None, None
    previous_conditions = {c.get("type"): c for c in (previous or {}).get("conditions") or []}
    fits = plan is not None and plan.fits
    # A spec that failed resolution (plan None) may hold anything in replicas: it deploys nothing then.
    desired = spec.replicas if plan is not None else 0
    dep_status = (deployment or {}).get("status") or {}
    ready = int(dep_status.get("readyReplicas") or 0)
    updated = int(dep_status.get("updatedReplicas") or 0)
    dep_generation = ((deployment or {}).get("metadata") or {}).get("generation")
    dep_observed = dep_status.get("observedGeneration")
    rolled = dep_generation is None or (dep_observed is not None and dep_observed >= dep_generation)

    conflict_message = (
        "objects under this InferenceService's child names exist but are not owned by it: "
        f"{', '.join(conflicts)} (kind, or kind/name for the router's); nothing is adopted or "
        "changed: delete or rename them"
        if conflicts
        else ""
    )
    if not fits:
        ready_c = (False, "CapacityNotPlanned", plan_message)
    elif conflicts:
        ready_c = (False, "ChildConflict", conflict_message)
    elif deployment is None:
        missing = "; ".join(m for m in missing_crds if workload_kind in m)
        ready_c = (
            False,
            f"{workload_kind}Missing",
            f"the {workload_kind} does not exist yet" + (f": {missing}" if missing else ""),
        )
    elif desired == 0:
        ready_c = (False, "ScaledToZero", "spec.replicas is 0")
    elif ready >= desired and updated >= desired and rolled:
        ready_c = (True, "AllReplicasReady", f"{ready}/{desired} replicas ready")
    elif pod_failure is not None:
        ready_c = (False, pod_failure.reason, f"{ready}/{desired} replicas ready: {pod_failure.message}")
    else:
        ready_c = (False, "ReplicasNotReady", f"{ready}/{desired} replicas ready, {updated} updated")

    if pools is not None and ready_c[0] and not pools_ready(pools):
        pre = pools["prefill"]
        ready_c = (
            False,
            "PrefillNotReady",
            f"decode {ready}/{desired} replicas ready, prefill {pre['readyReplicas']}/{pre['replicas']}",
        )
    if fits and deployment is not None and not ready_c[0] and desired > 0:
        progressing_c = (True, "RollingOut", f"{updated}/{desired} replicas updated, {ready} ready")
    elif fits and deployment is None and not conflicts:
        progressing_c = (True, "Creating", f"creating the {workload_kind}")
    else:
        progressing_c = (False, "Stable" if fits else "CapacityNotPlanned", "no rollout in progress")

    deadline = _deployment_condition(deployment, "Progressing")
    failure = _deployment_condition(deployment, "ReplicaFailure")
    if not fits and deployment is not None:
        degraded_c = (
            True,
            "SpecNotApplied",
            f"the new spec does not fit ({plan_reason}); the previous {workload_kind} keeps serving",
        )
    elif fits and missing_crds and not conflicts:
        degraded_c = (True, "CRDNotInstalled", "; ".join(missing_crds))
    elif fits and deployment is not None and pod_failure is not None:
        degraded_c = (True, pod_failure.reason, pod_failure.message)
    elif deadline.get("status") == "False" and deadline.get("reason") == "ProgressDeadlineExceeded":
        degraded_c = (True, "ProgressDeadlineExceeded", deadline.get("message", ""))
    elif failure.get("status") == "True":
        degraded_c = (True, "ReplicaFailure", failure.get("message", ""))
    else:
        degraded_c = (False, "AsExpected", "")

    conditions = [
        _condition("Ready", *ready_c, previous_conditions, now, generation),
        _condition("CapacityPlanned", fits, plan_reason, plan_message, previous_conditions, now, generation),
        _condition("Progressing", *progressing_c, previous_conditions, now, generation),
        _condition("Degraded", *degraded_c, previous_conditions, now, generation),
        _condition(
            "ChildConflict",
            bool(conflicts),
            "ChildConflict" if conflicts else "NoConflict",
            conflict_message,
            previous_conditions,
            now,
            generation,
        ),
    ]
    if model_ready is not None:
        conditions.append(_condition("ModelReady", *model_ready, previous_conditions, now, generation))
    if adapters is not None and adapters[1] > 0:
        conditions.append(
            _condition(
                "AdaptersReady", *_adapters_condition(*adapters, pod_failure), previous_conditions, now, generation
            )
        )
    if plan_drift is not None:
        conditions.append(_condition("PlanDrift", *plan_drift, previous_conditions, now, generation))
    status: dict[str, Any] = {
        "replicas": int(dep_status.get("replicas") or 0),
        "readyReplicas": ready,
        "selector": selector or selector_string(name),
        "conditions": conditions,
    }
    if generation is not None:
        status["observedGeneration"] = generation
    if plan is not None:
        status["plan"] = plan_status(plan)
    if parallelism is not None:
        status["parallelism"] = parallelism
    if pools is not None:
        status["disaggregation"] = pools
    if adapters is not None and adapters[1] > 0:
        status["adapters"] = f"{adapters[0]}/{adapters[1]}"
    if fits and not conflicts:
        status["url"] = service_url(url_service_name(spec, name), namespace, spec.port)
    return status


def _adapters_condition(ready: int, total: int, pod_failure: PodFailure | None) -> tuple[bool, str, str]:
    if pod_failure is not None and pod_failure.reason == "AdapterLoadFailed":
        return False, "AdapterLoadFailed", f"{ready}/{total} adapters served: {pod_failure.message}"
    if ready == total:
        return True, "AdaptersServed", f"every ready pod serves all {total} spec.adapters"
    return (
        False,
        "AdaptersLoading",
        f"{ready}/{total} adapters served by every ready pod (pods starting or rolling out)",
    )


def pools_status(pools: Pools, workloads: dict[str, dict | None]) -> dict[str, dict[str, int]]:
    """status.disaggregation: per pool, replicas (the workload's desired count: its spec.replicas, which an HPA
    may set, else the pool's), readyReplicas (the workload's status, groups for a LeaderWorkerSet), its pod
    shape and the KV tokens one replica of it holds (its plan). `workloads`: role -> live workload or None."""
    out = {}
    for pool in pools:
        live = workloads.get(pool.role) or {}
        desired = (live.get("spec") or {}).get("replicas")
        out[pool.role] = {
            "replicas": int(desired if desired is not None else pool.replicas),
            "readyReplicas": int((live.get("status") or {}).get("readyReplicas") or 0),
            "tensorParallelSize": pool.tensor_parallel_size,
            "nodes": pool.layout.nodes,
            "kvTokens": pool.plan.kv_tokens,
        }
    return out


def pools_ready(pools: dict[str, dict[str, int]]) -> bool:
    return all(p["readyReplicas"] >= p["replicas"] for p in pools.values())

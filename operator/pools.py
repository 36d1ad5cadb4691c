"""spec.disaggregation (issue 42) resolved: the prefill and decode pools' plans, layouts and autoscaling.

Each pool is planned by the one capacity planner (runtime/planner/kv_plan through layout.choose, the same call
spec.resolve makes for an aggregated replica) at the pool's own tensorParallelSize: its KV budget per GPU, the
pods per replica (one, else a LeaderWorkerSet group) and what the pod runs with come from there, never from a
second formula here. The checks mirror the CRD's CEL rules on spec.disaggregation (for `kvserve render` and
clusters without the CRD's validation) and add what only the catalog knows (a TP that does not divide the
model's heads), each naming the field.

Pure: no I/O. The renderer is operator/render/disaggregation.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvserve.operator.spec_model import DisaggregationSpec, InferenceServiceSpec, Resources
from kvserve.runtime.planner import kv_plan
from kvserve.runtime.planner.layout import Layout, ParallelismError, choose

ROLES = ("prefill", "decode")
# vLLM's kv_role per pool: prefill pods produce KV (compute the prompt, hold the blocks), decode pods consume it.
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
DEFAULT_CONNECTOR = "NixlConnector"
DEFAULT_TRANSFER_PORT = 5600  # vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT default
DEFAULT_PREFILL_REPLICAS = 1
DEFAULT_MIN_REPLICAS = 1
DEFAULT_TARGET_WAITING_REQUESTS = 5  # as spec.autoscaling.targetQueueDepth's default
# A decode pod with maxNumSeqs running requests is full (the next one queues); the HPA aims below that so the
# pods it adds are up before the pool is. KV usage likewise: at 100% the scheduler preempts.
RUNNING_TARGET_FRACTION = 0.8
DEFAULT_KV_CACHE_USAGE_PERCENT = 80


class PoolError(ValueError):
    """A spec.disaggregation that cannot be served; the message names the field."""


@dataclass(frozen=True)
class Pool:
    role: str  # prefill | decode
    tensor_parallel_size: int
    replicas: int  # without autoscaling (decode: spec.replicas)
    plan_input: kv_plan.PlanInput
    plan: kv_plan.Plan  # one replica of this pool, from the one planner
    layout: Layout
    # {minReplicas, maxReplicas, <metric target>...} for the pool's HPA; None: no HPA
    autoscaling: dict | None
    resources: Resources | None

    @property
    def kv_role(self) -> str:
        return KV_ROLES[self.role]


@dataclass(frozen=True)
class Pools:
    connector: str
    transfer_port: int
    prefill: Pool
    decode: Pool

    def __iter__(self) -> Iterator[Pool]:
        return iter((self.prefill, self.decode))

    def kv_transfer_config(self, pool: Pool) -> str:
        """--kv-transfer-config: vLLM's KVTransferConfig JSON, one pool's role."""
        return json.dumps({"kv_connector": self.connector, "kv_role": pool.kv_role}, separators=(",", ":"))

    def plan(self) -> kv_plan.Plan:
        """What status.plan and the CapacityPlanned condition report: the first pool that does not fit (its
        message naming the pool), else the decode pool's plan (the pool whose KV holds the running streams)."""
        for pool in self:
            if not pool.plan.fits:
                return dataclasses.replace(pool.plan, message=f"spec.disaggregation.{pool.role}: {pool.plan.message}")
        return self.decode.plan


def check_written(spec: dict) -> None:
    """The CRD's CEL rules on spec.disaggregation, on the manifest as written (defaults applied)."""
    disagg = spec.get("disaggregation")
    if disagg is None:
        return
    if not isinstance(disagg, dict):
        raise PoolError(f"spec.disaggregation must be an object with prefill and decode, got {disagg!r}")
    if not (spec.get("router") or {}).get("enabled"):
        raise PoolError(
            "spec.disaggregation needs spec.router.enabled: true: the router sends each request to a prefill "
            "and a decode pod (and serves it on a decode pod alone when the prompt is short)"
        )
    if (spec.get("autoscaling") or {}).get("enabled"):
        raise PoolError(
            "spec.autoscaling.enabled does not apply with spec.disaggregation: autoscale each pool with "
            "spec.disaggregation.prefill.autoscaling and spec.disaggregation.decode.autoscaling"
        )
    if spec.get("slo") is not None:
        raise PoolError(
            "spec.slo is not planned for disaggregated pools yet: remove spec.slo and spec.workload, or "
            "spec.disaggregation"
        )
    if (spec.get("parallelism") or {}).get("nodes") is not None:
        raise PoolError(
            "spec.parallelism.nodes does not apply with spec.disaggregation: each pool's pods per replica "
            "are chosen from its own plan"
        )
    gpus_per_node = (spec.get("parallelism") or {}).get("gpusPerNode")
    for role in ROLES:
        pool = disagg.get(role)
        if not isinstance(pool, dict):
            raise PoolError(f"spec.disaggregation.{role} is required (an object, may be empty)")
        tp = pool.get("tensorParallelSize")
        if isinstance(tp, int) and isinstance(gpus_per_node, int) and tp > gpus_per_node:
            raise PoolError(
                f"spec.disaggregation.{role}.tensorParallelSize {tp} must be <= spec.parallelism.gpusPerNode "
                f"{gpus_per_node}: a pod's GPUs come from one node"
            )
        auto = pool.get("autoscaling")
        if isinstance(auto, dict):
            low, high = auto.get("minReplicas", DEFAULT_MIN_REPLICAS), auto.get("maxReplicas")
            if not isinstance(high, int) or high < 1:
                raise PoolError(
                    f"spec.disaggregation.{role}.autoscaling.maxReplicas must be an integer >= 1, got {high!r}"
                )
            if isinstance(low, int) and low > high:
                raise PoolError(
                    f"spec.disaggregation.{role}.autoscaling.minReplicas {low} must be <= maxReplicas {high}"
                )


def resolve(
    spec: InferenceServiceSpec,
    plan_input: kv_plan.PlanInput,
    *,
    gpus_per_node: int,
    extra_args: Sequence[str],
    refuse: str | None = None,
) -> Pools | None:
    """The pools of spec.disaggregation (None without it). `plan_input`: the aggregated replica's planner
    input (model, GPU, engine settings, adapter slots); each pool replaces its tensorParallelSize.
    `refuse`: an engine-setting error that makes every plan not fit (spec.resolve's chunked-prefill check)."""
    disagg: DisaggregationSpec | None = spec.disaggregation
    if disagg is None:
        return None
    built = {}
    for role in ROLES:
        pool_spec = getattr(disagg, role)
        tp = pool_spec.tensor_parallel_size or spec.gpu.tensor_parallel_size
        where = f"spec.disaggregation.{role}.tensorParallelSize" + (
            "" if pool_spec.tensor_parallel_size else " (default spec.gpu.tensorParallelSize)"
        )
        tp_error = kv_plan.tensor_parallel_error(plan_input.model, tp)
        if tp_error:
            valid = ", ".join(str(t) for t in kv_plan.valid_tensor_parallel_sizes(plan_input.model))
            raise PoolError(f"{where} {tp}: {tp_error} (valid for this model: {valid})")
        pool_input = dataclasses.replace(plan_input, tensor_parallel_size=tp, pipeline_parallel_size=1)
        try:
            plan, layout = choose(
                pool_input, kv_plan.plan(pool_input), nodes=None, gpus_per_node=gpus_per_node, extra_args=extra_args
            )
        except ParallelismError as exc:
            raise PoolError(f"spec.disaggregation.{role}: {exc}") from None
        if layout.multinode:  # the plan the pods run: PP stages of TP GPUs each (as spec.resolve)
            pool_input = dataclasses.replace(pool_input, pipeline_parallel_size=layout.pipeline_parallel_size)
            if plan_input.max_loras and plan.fits:  # the runtime refuses LoRA with pipeline parallelism
                plan = dataclasses.replace(
                    plan,
                    fits=False,
                    reason="PipelineParallelUnsupported",
                    message=f"spec.adapters (LoRA) cannot be combined with pipeline parallelism: a {role} replica "
                    f"needs {layout.nodes} pods ({layout.reason})",
                )
        if refuse and plan.fits:
            plan = dataclasses.replace(plan, fits=False, reason="InvalidEngineConfig", message=refuse)
        replicas = spec.replicas if role == "decode" else (pool_spec.replicas or DEFAULT_PREFILL_REPLICAS)
        built[role] = Pool(
            role=role,
            tensor_parallel_size=tp,
            replicas=replicas,
            plan_input=pool_input,
            plan=plan,
            layout=layout,
            autoscaling=_bounds(role, pool_spec.autoscaling, spec),
            resources=pool_spec.resources,
        )
    return Pools(
        connector=disagg.connector or DEFAULT_CONNECTOR,
        transfer_port=disagg.transfer_port or DEFAULT_TRANSFER_PORT,
        prefill=built["prefill"],
        decode=built["decode"],
    )


def _bounds(role: str, auto, spec: InferenceServiceSpec) -> dict | None:
    """The pool's HPA settings, the operator's defaults filled in; None when the pool does not autoscale."""
    if auto is None:
        return None
    low = auto.min_replicas if auto.min_replicas is not None else DEFAULT_MIN_REPLICAS
    if low > auto.max_replicas:
        raise PoolError(
            f"spec.disaggregation.{role}.autoscaling.minReplicas {low} must be <= maxReplicas {auto.max_replicas}"
        )
    out = {"minReplicas": low, "maxReplicas": auto.max_replicas}
    if role == "prefill":
        out["targetWaitingRequests"] = auto.target_waiting_requests or DEFAULT_TARGET_WAITING_REQUESTS
    else:
        out["targetRunningRequests"] = auto.target_running_requests or max(
            1, math.floor(RUNNING_TARGET_FRACTION * spec.engine.max_num_seqs)
        )
        out["targetKVCacheUsagePercent"] = auto.target_kv_cache_usage_percent or DEFAULT_KV_CACHE_USAGE_PERCENT
    return out

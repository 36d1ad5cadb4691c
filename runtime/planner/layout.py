"""How many pods one replica spans, and why: one pod (a Deployment) or a group of `nodes` pods (a LeaderWorkerSet),
one pipeline stage per pod. Pure: planner numbers in, (plan, Layout) out.

The rule (issue 28), with the pod's GPU count gpu.tensorParallelSize and a node's spec.parallelism.gpusPerNode:
- spec.parallelism.nodes set: PP = nodes, TP = gpu.tensorParallelSize GPUs per pod; the plan must fit that.
- otherwise one pod when the plan fits. When it does not and the pod already has every GPU of a node
  (tensorParallelSize == gpusPerNode), the plan needs more GPUs than one pod may have: TP = gpusPerNode within
  each pod (all-reduce over NVLink) x the fewest PP stages that fit (kv_plan.plan_multinode), one per node.
- a smaller pod that does not fit stays refused (the user asked for that many GPUs per replica); the message
  says what would fit: a wider pod, or the multi-node layout.
The capacity of a PP plan is the runtime's: every rank gets the same --kv-cache-bytes, each stage turns it into
blocks for its own layers, and the world takes the minimum, so the stage with the most layers and the heaviest
weights decides (kv_plan.plan with pipeline_parallel_size, all from runtime/capacity.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.runtime import capacity
from kvserve.runtime.planner import kv_plan

DEFAULT_GPUS_PER_NODE = 8
PIPELINE_ARCHITECTURES = capacity.PIPELINE_ARCHITECTURES  # the runtime's own list (config.py refuses the rest)
# `kvserve serve` flags the runtime refuses beside --pipeline-parallel-size > 1 (runtime/config.py).
PIPELINE_INCOMPATIBLE_FLAGS = ("--enable-lora", "--cuda-graphs", "--speculative-config")
_FITS_ELSEWHERE = ("WeightsDoNotFit", "ContextDoesNotFit")


class ParallelismError(ValueError):
    """A spec.parallelism setting that cannot be served; the message names the field."""


@dataclass(frozen=True)
class Stage:
    index: int
    num_layers: int
    weight_bytes_per_gpu: int  # capacity.stage_weight_bytes_per_rank


@dataclass(frozen=True)
class Layout:
    nodes: int  # pods per replica (the LeaderWorkerSet's size); 1 = a Deployment
    tensor_parallel_size: int  # GPUs per pod
    pipeline_parallel_size: int  # = nodes: one stage per pod, so only activations cross nodes
    gpus_per_node: int
    reason: str  # what was chosen and why, in spec field names (status.parallelism.reason)
    stages: tuple[Stage, ...] = ()
    deciding_stage: int = 0  # the stage with the least KV room per GPU

    @property
    def multinode(self) -> bool:
        return self.nodes > 1

    def to_status(self) -> dict:
        return {
            "nodes": self.nodes,
            "tensorParallelSize": self.tensor_parallel_size,
            "pipelineParallelSize": self.pipeline_parallel_size,
            "gpusPerReplica": self.nodes * self.tensor_parallel_size,
            "stageLayers": [s.num_layers for s in self.stages],
            "decidingStage": self.deciding_stage,
            "reason": self.reason,
        }


def stages(inp: kv_plan.PlanInput, plan: kv_plan.Plan) -> tuple[tuple[Stage, ...], int]:
    """Each stage's layers and weights per GPU, and the stage that decides the group's KV capacity
    (capacity.kv_tokens_per_rank: the least room per token after its weights, of what the plan leaves for
    weights + KV on each GPU)."""
    m, t, pp = inp.model, inp.tensor_parallel_size, inp.pipeline_parallel_size
    ranges = capacity.stage_layer_ranges(m.num_layers, pp)
    out = tuple(
        Stage(s, len(layers), capacity.stage_weight_bytes_per_rank(m, inp.dtype, t, layers, s == 0, s == pp - 1))
        for s, layers in enumerate(ranges)
    )
    room = plan.memory_budget_bytes_per_gpu - plan.activation_reserve_bytes - plan.runtime_overhead_bytes
    _, deciding = capacity.kv_tokens_per_rank(m, inp.dtype, inp.kv_cache_dtype, t, pp, max(room, 0))
    return out, deciding


def _layout(inp: kv_plan.PlanInput, plan: kv_plan.Plan, nodes: int, gpus_per_node: int, reason: str) -> Layout:
    if nodes == 1:
        return Layout(1, inp.tensor_parallel_size, 1, gpus_per_node, reason)
    stage_list, deciding = stages(dataclasses.replace(inp, pipeline_parallel_size=nodes), plan)
    return Layout(nodes, inp.tensor_parallel_size, nodes, gpus_per_node, reason, stage_list, deciding)


def pipeline_error(inp: kv_plan.PlanInput, extra_args: Sequence[str]) -> str | None:
    """What the runtime would refuse about a pipelined replica, before any pod starts."""
    m = inp.model
    if m.architecture not in PIPELINE_ARCHITECTURES:
        return (
            f"pipeline parallelism (more than one pod per replica) does not support {m.architecture} yet "
            f"(supported: {', '.join(PIPELINE_ARCHITECTURES)})"
        )
    if len(capacity.shape_kv_cache_groups(m)) > 1:
        return (
            "pipeline parallelism (more than one pod per replica) does not support sliding-window KV cache groups yet"
        )
    for arg in extra_args:
        flag = str(arg).split("=", 1)[0]
        if flag in PIPELINE_INCOMPATIBLE_FLAGS:
            return f"spec.engine.extraArgs {flag} cannot be combined with pipeline parallelism (more than one pod)"
    return None


def _refused(plan: kv_plan.Plan, reason: str, message: str) -> kv_plan.Plan:
    return dataclasses.replace(plan, fits=False, reason=reason, message=message)


def _wider_hint(inp: kv_plan.PlanInput, gpus_per_node: int) -> str:
    """For a refused pod smaller than a node: the smallest wider pod that fits, else the multi-node layout."""
    for tp in kv_plan.valid_tensor_parallel_sizes(inp.model, limit=gpus_per_node):
        if tp > inp.tensor_parallel_size and kv_plan.plan(dataclasses.replace(inp, tensor_parallel_size=tp)).fits:
            return f"gpu.tensorParallelSize {tp} fits one pod"
    if kv_plan.tensor_parallel_error(inp.model, gpus_per_node):
        return ""
    multi, _ = kv_plan.plan_multinode(dataclasses.replace(inp, tensor_parallel_size=gpus_per_node), gpus_per_node)
    if not multi.fits:
        return ""
    pp = multi.pipeline_parallel_size
    return (
        f"set gpu.tensorParallelSize {gpus_per_node} (= spec.parallelism.gpusPerNode) and the operator spans "
        f"{pp} pods per replica (a LeaderWorkerSet, TP {gpus_per_node} x PP {pp})"
    )


def choose(
    inp: kv_plan.PlanInput,
    first: kv_plan.Plan,
    *,
    nodes: int | None = None,
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
    extra_args: Sequence[str] = (),
) -> tuple[kv_plan.Plan, Layout]:
    """(the plan to serve, its layout). `first` is kv_plan.plan(inp) for one pod; `nodes` and `gpus_per_node`
    are spec.parallelism's (None: choose), `extra_args` spec.engine.extraArgs. Raises ParallelismError for
    settings no plan can serve."""
    t = inp.tensor_parallel_size
    if t > gpus_per_node:
        raise ParallelismError(
            f"gpu.tensorParallelSize {t} exceeds spec.parallelism.gpusPerNode {gpus_per_node}: a pod's GPUs "
            "come from one node"
        )
    if nodes is not None:
        if nodes < 1 or nodes > inp.model.num_layers:
            raise ParallelismError(
                f"spec.parallelism.nodes {nodes} must be between 1 and the model's {inp.model.num_layers} "
                "layers (one pipeline stage per pod)"
            )
        if nodes == 1:
            return first, _layout(inp, first, 1, gpus_per_node, "spec.parallelism.nodes 1: one pod per replica")
        error = pipeline_error(inp, extra_args)
        staged = kv_plan.plan(dataclasses.replace(inp, pipeline_parallel_size=nodes))
        reason = (
            f"spec.parallelism.nodes {nodes}: TP {t} per pod (gpu.tensorParallelSize) x PP {nodes}, one "
            "pipeline stage per pod (only activations cross nodes)"
        )
        if error:
            staged = _refused(staged, "PipelineParallelUnsupported", error)
        return staged, _layout(inp, staged, nodes, gpus_per_node, reason)
    if first.fits or first.reason not in _FITS_ELSEWHERE:
        return first, _layout(inp, first, 1, gpus_per_node, f"fits one pod: TP {t}")
    if t < gpus_per_node:  # a wider pod or the multi-node layout would fit: say which, refuse what was asked
        hint = _wider_hint(inp, gpus_per_node)
        message = f"{first.message}; {hint}" if hint else first.message
        return dataclasses.replace(first, message=message), _layout(inp, first, 1, gpus_per_node, hint or first.reason)
    multi, why = kv_plan.plan_multinode(inp, gpus_per_node)
    if not multi.fits:
        return first, _layout(inp, first, 1, gpus_per_node, why)
    pp = multi.pipeline_parallel_size
    error = pipeline_error(inp, extra_args)
    reason = (
        f"does not fit one pod of gpu.tensorParallelSize {t} = spec.parallelism.gpusPerNode ({first.reason}); "
        f"chose TP {t} within each pod (all-reduce over NVLink) x PP {pp} pods per replica (one pipeline stage "
        "per node: only activations cross nodes), the fewest stages that fit"
    )
    if error:
        return _refused(first, "PipelineParallelUnsupported", f"{first.message}; multi-node would need: {error}"), (
            _layout(inp, first, 1, gpus_per_node, error)
        )
    return multi, _layout(inp, multi, pp, gpus_per_node, reason)

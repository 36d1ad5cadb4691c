"""How long an engine pod may take to start before the kubelet restarts it: the startupProbe's budget, derived
from the runtime's start-up phases (runtime/startup_phases.py) and the model's size (issue 43), unless
spec.startupTimeoutSeconds fixes it.

The probe starts with the engine container: scheduling, the image pull and the model-download init container
come before it (status.lastReplicaStartup measures those, operator/pod_startup.py). From then until /health
answers 200 the runtime runs the phases it times and exports as kvserve:startup_phase_seconds{phase}:

    expected_s = weight_load + kernel_compile + cuda_graph_capture + the other phases
      weight_load        = the pod's weight bytes / WEIGHT_READ_BYTES_PER_S
      kernel_compile     = KERNEL_COMPILE_SECONDS, unless `--attention-backend torch` (nothing to compile): the
                           Triton kernels are JIT-compiled on the first forward (the memory profile's) and the
                           runtime image ships no compilation cache (docs/serving.md)
      cuda_graph_capture = CUDA_GRAPH_CAPTURE_SECONDS with `--cuda-graphs`, else 0
      the other phases   = OTHER_PHASE_SECONDS summed (distributed_init only with more than one GPU rank)
    budget_s  = max(MIN_BUDGET_SECONDS, ceil(SAFETY_FACTOR x expected_s))
    probe     = periodSeconds PERIOD_SECONDS, failureThreshold ceil(budget_s / PERIOD_SECONDS)

The figures are estimates for a GPU pod, not measurements (this project has no GPU to measure on; the CPU
phases measured on a shared 2-core machine are in docs/serving.md): the read speed is a network volume's (AWS
gp3's 125 MB/s baseline; local NVMe reads ten times faster), so the budget errs long. Too long only delays
restarting a pod whose start-up hangs; too short restarts a healthy pod in a loop, and so the safety factor.
A pod on slower storage, or one that must be restarted sooner, sets spec.startupTimeoutSeconds: that many
seconds, the budget replaced. The Deployment's progress deadline is the budget plus PROGRESS_MARGIN_SECONDS.

Pure: the spec and its capacity plan in, seconds out.
"""

from __future__ import annotations

import math

from kvserve.operator.spec_model import InferenceServiceSpec
from kvserve.runtime.planner.kv_plan import Plan

PERIOD_SECONDS = 10
WEIGHT_READ_BYTES_PER_S = 125_000_000
KERNEL_COMPILE_SECONDS = 120
CUDA_GRAPH_CAPTURE_SECONDS = 60
# The phases whose time does not grow with the model (runtime/startup_phases.ORDER names): a torch interpreter
# and CUDA context per process, the rank rendezvous, one profiling forward, the KV cache's allocation.
OTHER_PHASE_SECONDS = {
    "model_resolve": 5,
    "engine_config": 10,
    "tokenizer_load": 10,
    "engine_process_start": 30,
    "distributed_init": 30,
    "kernel_load": 5,
    "memory_profile": 30,
    "kv_cache_allocate": 10,
}
SAFETY_FACTOR = 2
MIN_BUDGET_SECONDS = 300
PROGRESS_MARGIN_SECONDS = 600  # the Deployment waits this long past the probe before "progress deadline exceeded"


def _has_flag(spec: InferenceServiceSpec, flag: str, value: str | None = None) -> bool:
    args = [str(a) for a in spec.engine.extra_args or []]
    for i, arg in enumerate(args):
        name, _, inline = arg.partition("=")
        if name != flag:
            continue
        given = inline if inline else (args[i + 1] if i + 1 < len(args) else "")
        if value is None or given == value:
            return True
    return False


def expected_phase_seconds(spec: InferenceServiceSpec, plan: Plan, pods_per_replica: int = 1) -> dict[str, float]:
    """The expected seconds of each start-up phase of one engine pod (phases that will not run are left out)."""
    ranks = spec.gpu.tensor_parallel_size * pods_per_replica
    pod_weight_bytes = plan.weight_bytes_per_gpu * spec.gpu.tensor_parallel_size
    phases: dict[str, float] = {
        name: seconds for name, seconds in OTHER_PHASE_SECONDS.items() if name != "distributed_init" or ranks > 1
    }
    phases["weight_load"] = pod_weight_bytes / WEIGHT_READ_BYTES_PER_S
    if not _has_flag(spec, "--attention-backend", "torch"):
        phases["kernel_compile"] = KERNEL_COMPILE_SECONDS
    if _has_flag(spec, "--cuda-graphs"):
        phases["cuda_graph_capture"] = CUDA_GRAPH_CAPTURE_SECONDS
    return phases


def budget_seconds(spec: InferenceServiceSpec, plan: Plan, pods_per_replica: int = 1) -> int:
    """spec.startupTimeoutSeconds when set, else the derived budget (the module's formula)."""
    if spec.startup_timeout_seconds is not None:
        return spec.startup_timeout_seconds
    expected = sum(expected_phase_seconds(spec, plan, pods_per_replica).values())
    return max(MIN_BUDGET_SECONDS, math.ceil(SAFETY_FACTOR * expected))


def failure_threshold(budget_s: int) -> int:
    return math.ceil(budget_s / PERIOD_SECONDS)

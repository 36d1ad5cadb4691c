"""Default CPU and host-memory requests for an engine pod, sized from the plan; spec.resources overrides them.

Without requests a GPU pod is BestEffort for CPU and memory: the scheduler may pack it next to memory-hungry
pods and the kubelet evicts it first under node pressure, which for a pod that spent minutes loading weights
is the worst choice. The figures are host-side estimates, not measurements (no GPU here):
- each GPU rank runs one worker process: torch + CUDA context host memory + pinned staging buffers for
  host-to-device copies, about 4 GiB, and one CPU core to launch kernels without stalling the GPU;
- the front process (HTTP server, tokenizer, detokenizer, scheduler) about 2 GiB and one core;
- `--preemption-mode swap` keeps swapped-out KV blocks in host RAM: `--swap-space` bytes (runtime default 4 GiB).
Memory limits are not defaulted: the memory-backed /dev/shm counts against a limit, so a limit is the user's
explicit choice (spec.resources.limits).
"""

from __future__ import annotations

import math

from kvserve.operator.spec import Resolved
from kvserve.runtime.engine_args import DEFAULT_SWAP_SPACE_BYTES as RUNTIME_DEFAULT_SWAP_SPACE_BYTES
from kvserve.runtime.engine_args import parse_bytes  # the runtime's own parser for --swap-space

GiB = 1 << 30
MiB = 1 << 20
FRONT_PROCESS_BYTES = 2 * GiB
HOST_BYTES_PER_RANK = 4 * GiB
FRONT_PROCESS_CPU = 1
CPU_PER_RANK = 1


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def swap_space_bytes(extra_args: list[str]) -> int:
    """Host RAM the runtime reserves for swapped KV blocks, from the pod's extra arguments."""
    args = [str(a) for a in extra_args]
    if _flag_value(args, "--preemption-mode") != "swap":
        return 0
    value = _flag_value(args, "--swap-space")
    return parse_bytes(value) if value is not None else RUNTIME_DEFAULT_SWAP_SPACE_BYTES


def default_requests(resolved: Resolved) -> dict[str, str]:
    ranks = resolved.spec.gpu.tensor_parallel_size
    memory = FRONT_PROCESS_BYTES + ranks * HOST_BYTES_PER_RANK + swap_space_bytes(resolved.spec.engine.extra_args or [])
    return {"cpu": str(FRONT_PROCESS_CPU + ranks * CPU_PER_RANK), "memory": f"{math.ceil(memory / MiB)}Mi"}

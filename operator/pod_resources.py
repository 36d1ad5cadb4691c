"""Default CPU and host-memory requests for an engine pod, sized from the plan; spec.resources overrides them.

Without requests a GPU pod is BestEffort for CPU and memory: the scheduler may pack it next to memory-hungry
pods and the kubelet evicts it first under node pressure, which for a pod that spent minutes loading weights
is the worst choice. The figures are host-side estimates, not measurements (no GPU here):
- each GPU rank runs one worker process: torch + CUDA context host memory + pinned staging buffers for
  host-to-device copies, about 4 GiB, and one CPU core to launch kernels without stalling the GPU;
- the front process (HTTP server, tokenizer, detokenizer, scheduler) about 2 GiB and one core;
- `--preemption-mode swap` keeps swapped-out KV blocks in host RAM: `--swap-space` bytes (runtime default 4 GiB).
- the host KV tier (spec.kvCache.offload.hostSizeGiB, operator/kv_offload.py): the pod's ranks' share of it,
  allocated (pinned on GPUs) at start-up; the disk tier on an emptyDir requests its volume's ephemeral-storage.
Memory limits are not defaulted: the memory-backed /dev/shm counts against a limit, so a limit is the user's
explicit choice (spec.resources.limits). A memory request or limit the user writes must still hold the bytes the
engine pins at start-up (swap space and host tier): `check_memory` refuses one that cannot.
"""

from __future__ import annotations

import math
import re

from kvserve.operator import kv_offload
from kvserve.operator.spec_model import InferenceServiceSpec
from kvserve.runtime.engine_args import DEFAULT_SWAP_SPACE_BYTES as RUNTIME_DEFAULT_SWAP_SPACE_BYTES
from kvserve.runtime.engine_args import parse_bytes  # the runtime's own parser for --swap-space

GiB = 1 << 30
MiB = 1 << 20
FRONT_PROCESS_BYTES = 2 * GiB
HOST_BYTES_PER_RANK = 4 * GiB
FRONT_PROCESS_CPU = 1
CPU_PER_RANK = 1


def swap_space_bytes(extra_args: list[str]) -> int:
    """Host RAM the runtime reserves for swapped KV blocks, from the pod's extra arguments."""
    args = [str(a) for a in extra_args]
    if kv_offload.flag_value(args, "--preemption-mode") != "swap":
        return 0
    value = kv_offload.flag_value(args, "--swap-space")
    return parse_bytes(value) if value is not None else RUNTIME_DEFAULT_SWAP_SPACE_BYTES


def pinned_host_bytes(spec: InferenceServiceSpec, pods_per_replica: int = 1) -> int:
    """Host RAM the engine allocates at start-up whatever the traffic: swap space and its share of the host KV
    tier (issue 41)."""
    return swap_space_bytes(spec.engine.extra_args or []) + kv_offload.host_bytes_per_pod(spec, pods_per_replica)


def default_requests(spec: InferenceServiceSpec, pods_per_replica: int = 1) -> dict[str, str]:
    """`pods_per_replica`: the layout's pods (a multi-pod replica's pods each hold their ranks' share)."""
    ranks = spec.gpu.tensor_parallel_size
    memory = FRONT_PROCESS_BYTES + ranks * HOST_BYTES_PER_RANK + pinned_host_bytes(spec, pods_per_replica)
    out = {"cpu": str(FRONT_PROCESS_CPU + ranks * CPU_PER_RANK), "memory": f"{math.ceil(memory / MiB)}Mi"}
    tier = kv_offload.offload(spec)
    if tier is not None and tier.disk is not None and not tier.disk.storage_class_name:  # an emptyDir: node disk
        out["ephemeral-storage"] = f"{math.ceil(kv_offload.disk_volume_bytes(spec) / MiB)}Mi"
    return out


_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?$")
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"m": -1, "k": 1, "M": 2, "G": 3, "T": 4, "P": 5, "E": 6}


def quantity_bytes(value: object) -> float | None:
    """A Kubernetes quantity ("16Gi", "1e9", "500M", 1024) as a number; None when it is not one (the API server
    refuses the pod then, in its own words)."""
    match = _QUANTITY.match(str(value).strip())
    if not match:
        return None
    number, suffix = float(match.group(1)), match.group(2) or ""
    if suffix in _BINARY:
        return number * 1024 ** _BINARY[suffix]
    if suffix in _DECIMAL:
        return number * 1000 ** _DECIMAL[suffix]
    return number * 10 ** int(suffix[1:]) if suffix else number


def check_memory(spec: InferenceServiceSpec, pods_per_replica: int = 1) -> str | None:
    """A spec.resources memory request or limit below what the engine pins at start-up (swap space, host KV
    tier) would only ever OOM-kill or mis-schedule the pod: the message naming the field, or None."""
    pinned = pinned_host_bytes(spec, pods_per_replica)
    if pinned == 0 or spec.resources is None:
        return None
    for kind, values in (("requests", spec.resources.requests), ("limits", spec.resources.limits)):
        written = (values or {}).get("memory")
        if written is None:
            continue
        have = quantity_bytes(written)
        if have is not None and have < pinned:
            return (
                f"spec.resources.{kind}.memory ({written}) is below the {pinned / GiB:g} GiB of host RAM the engine "
                "allocates at start-up (spec.kvCache.offload.hostSizeGiB's share for this pod plus --swap-space): "
                "raise it above that (the processes need their own memory on top), or leave it unset: the "
                "operator's default request counts it"
            )
    return None

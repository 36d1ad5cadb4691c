"""`spec.kvCache.offload` (issue 41): the KV tiers below the device pool, as the operator counts them.

One home for what the tier costs a pod, so the memory request (pod_resources), the engine flags and the disk
volume (render/kv_offload.py), the checks (spec.resolve) and the status / `kvserve plan` line agree:
- host tier: `hostSizeGiB` per replica -> `--kv-offloading-size` (vLLM's flag: the total over the replica's
  tensor/pipeline-parallel ranks, each rank holding its share; pinned host memory on GPUs). A pod holds the
  share of its own ranks: the whole tier for a one-pod replica, 1/nodes of it for a multi-pod one. Those bytes
  are allocated at start-up, so they are added to the pod's memory request, and a memory request or limit the
  user writes must hold them.
- disk tier: `disk.sizeGiB` -> `--kv-offloading-disk-dir DISK_MOUNT --kv-offloading-disk-size`, on a volume per
  pod (an emptyDir, or a generic ephemeral PVC of `disk.storageClassName`): the runtime's disk tier is one
  engine's (its index and LRU are in that engine's memory), so two pods must never share a directory. A volume
  per pod survives the engine's restarts inside the pod (the runtime reuses files of the same model and KV
  layout), not the pod's replacement.
- remote tier: `remoteUrl` -> `--kv-offloading-remote-url`, an existing Redis / Valkey the pods share (not
  deployed here); it costs the pod nothing beyond the host tier it is staged through.
Without spec.kvCache.offload, `--kv-offloading-size` in extraArgs is counted the same way (like --swap-space).

Pure: spec in, numbers and messages out. `check` returns the first problem naming the field (spec.resolve
raises it as SpecError InvalidKVCacheOffload).
"""

from __future__ import annotations

import math

from kvserve.operator.spec_model import InferenceServiceSpec, KVOffloadSpec

GiB = 1 << 30
MiB = 1 << 20
DISK_MOUNT = "/mnt/kv-offload"
DISK_VOLUME = "kv-offload"
# The volume is this much larger than the tier: a file being written under its temporary name before the rename,
# the layout file, and the index trimming only after a write (runtime/executor/disk_store.py).
DISK_HEADROOM = 1.1
# Flags spec.kvCache.offload renders (extraArgs must not carry them as well: the last one would win silently).
FLAGS = ("--kv-offloading-size", "--kv-offloading-disk-dir", "--kv-offloading-disk-size", "--kv-offloading-remote-url")


def flag_value(args: list[str], flag: str) -> str | None:
    """The value of `--flag V` or `--flag=V` in an engine command line (extraArgs); None when absent."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def offload(spec: InferenceServiceSpec) -> KVOffloadSpec | None:
    return spec.kv_cache.offload if spec.kv_cache is not None else None


def host_bytes_per_replica(spec: InferenceServiceSpec) -> int:
    """The host tier over the replica's ranks: spec.kvCache.offload.hostSizeGiB, else --kv-offloading-size in
    extraArgs (0 when neither, or when that value is no number: the runtime then refuses it with its words)."""
    tier = offload(spec)
    if tier is not None:
        return int(tier.host_size_gib * GiB)
    value = flag_value([str(a) for a in spec.engine.extra_args or []], "--kv-offloading-size")
    try:
        return max(0, int(float(value) * GiB)) if value is not None else 0
    except ValueError:
        return 0


def host_bytes_per_pod(spec: InferenceServiceSpec, pods_per_replica: int = 1) -> int:
    """What one pod of the replica pins: its ranks' share of the tier (rounded up)."""
    return math.ceil(host_bytes_per_replica(spec) / max(1, pods_per_replica))


def disk_volume_bytes(spec: InferenceServiceSpec) -> int:
    """The disk tier's volume size (the tier plus DISK_HEADROOM); 0 without a disk tier."""
    tier = offload(spec)
    if tier is None or tier.disk is None:
        return 0
    return math.ceil(tier.disk.size_gib * GiB * DISK_HEADROOM)


def check(spec: InferenceServiceSpec, pods_per_replica: int, sliding_layers: int) -> str | None:
    """What the runtime would refuse at start-up (a pod in a crash loop), said here naming the field; the CRD's
    CEL rules say the first two too. `sliding_layers`: the model's sliding-window layers (the tier is off for
    them in the runtime's KV manager)."""
    tier = offload(spec)
    if tier is None:
        return None
    if not spec.engine.enable_prefix_caching:
        return "spec.kvCache.offload needs spec.engine.enablePrefixCaching true: the tiers hold prefix-cache blocks"
    if tier.disk is not None and spec.gpu.tensor_parallel_size * pods_per_replica > 1:
        return (
            f"spec.kvCache.offload.disk runs with one GPU rank only (this replica has "
            f"{spec.gpu.tensor_parallel_size * pods_per_replica}: gpu.tensorParallelSize "
            f"{spec.gpu.tensor_parallel_size} x {pods_per_replica} pods): a failed read on another rank would go "
            "unseen; drop the disk tier or serve the model on one GPU"
        )
    if sliding_layers > 0:
        return (
            f"spec.kvCache.offload: the model has {sliding_layers} sliding-window layers, and the runtime keeps no "
            "KV tier for sliding-window models yet; remove spec.kvCache.offload"
        )
    args = [str(a).split("=", 1)[0] for a in spec.engine.extra_args or []]
    for flag in FLAGS:
        if flag in args:
            return (
                f"spec.engine.extraArgs carries {flag} while spec.kvCache.offload sets the tiers: drop it from "
                "extraArgs (spec.kvCache.offload.hostSizeGiB / disk.sizeGiB say the same, and count the memory)"
            )
    return None


def status(spec: InferenceServiceSpec, pods_per_replica: int = 1) -> dict | None:
    """status.kvOffload and `kvserve plan -f`'s entry: the tiers and what they cost a pod; None without a tier."""
    per_replica = host_bytes_per_replica(spec)
    if per_replica == 0:
        return None
    out: dict = {
        "hostBytesPerReplica": per_replica,
        "hostBytesPerPod": host_bytes_per_pod(spec, pods_per_replica),  # in the pod's memory request
    }
    tier = offload(spec)
    if tier is not None and tier.disk is not None:
        out["diskBytes"] = int(tier.disk.size_gib * GiB)
        out["diskVolume"] = (
            f"ephemeral PVC ({tier.disk.storage_class_name})" if tier.disk.storage_class_name else "emptyDir"
        )
    return out


def describe(entry: dict) -> str:
    """One line of `kvserve plan -f`'s table for status()'s entry."""
    text = (
        f"kv offload (spec.kvCache.offload): host tier {entry['hostBytesPerReplica'] / GiB:g} GiB per replica, "
        f"{entry['hostBytesPerPod'] / GiB:g} GiB per pod (in its memory request)"
    )
    if "diskBytes" in entry:
        text += f"; disk tier {entry['diskBytes'] / GiB:g} GiB on {entry['diskVolume']}"
    return text

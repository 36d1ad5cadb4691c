"""What `kvserve plan` suggests when a plan does not fit: a larger tensor-parallel size on one node, or a catalog
GPU with more memory. Pure: the caller says whether a candidate fits (`kvserve plan` resolves it through the
operator's spec path, so the suggestion is what the operator would accept)."""

from __future__ import annotations

from collections.abc import Callable

from kvserve.runtime.planner import catalog, kv_plan


def wider_tensor_parallel_size(
    model: catalog.ModelShape, current: int, gpus_per_node: int, fits: Callable[[int], bool]
) -> int | None:
    """The smallest tensor-parallel size above `current` that the model's heads divide, within one node
    (<= gpus_per_node), and that `fits`; None when none does."""
    for tp in kv_plan.valid_tensor_parallel_sizes(model, limit=gpus_per_node):
        if tp > current and fits(tp):
            return tp
    return None


def bigger_gpu(current: catalog.GPU, fits: Callable[[str], bool]) -> str | None:
    """The catalog GPU with the least memory above `current`'s that `fits` (ties: the cheaper), else None."""
    bigger = sorted(
        (gpu.memory_mib, gpu.usd_per_gpu_hour, key)
        for key, gpu in catalog.GPUS.items()
        if gpu.memory_mib > current.memory_mib
    )
    return next((key for _, _, key in bigger if fits(key)), None)

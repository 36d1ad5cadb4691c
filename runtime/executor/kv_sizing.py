"""The runtime's KV-cache sizing decision, torch-free, so the capacity contract test can run it for a
70B-shaped config without allocating anything (tests/operator/test_capacity_contract.py).

An explicit budget (`--num-kv-blocks`, `--kv-cache-bytes`: what the operator renders from its plan) is
turned into blocks with kvserve.runtime.capacity, the same arithmetic the planner used; only a CUDA device
without a budget profiles (model_runner.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvserve.runtime import capacity
from kvserve.runtime.config import EngineConfig
from kvserve.runtime.errors import InvalidParameter

logger = logging.getLogger("kvserve.runner")


def budget_source(config: EngineConfig) -> str:
    """The setting that decides the KV budget (named in errors and the startup log)."""
    cache = config.cache
    return (
        "num_kv_blocks"
        if cache.num_kv_blocks is not None
        else "kv_cache_bytes"
        if cache.kv_cache_bytes is not None
        else "gpu_memory_utilization"
    )


def layout(config: EngineConfig) -> capacity.KVLayout:
    return config.model.kv_layout(config.cache.kv_cache_dtype, config.cache.block_size, config.tensor_parallel_size)


def lora_slot_bytes(config: EngineConfig) -> int:
    """Device bytes of --enable-lora's adapter slots on one rank (capacity.lora_slot_bytes_per_rank, the
    formula the planner takes off the KV budget). The model runner allocates them with the model, before the
    KV cache is sized, on every device: a profiled budget's peak already holds them, and an explicit
    --kv-cache-bytes from a plan had them taken off by the planner, so neither subtracts them again."""
    lora = config.lora
    if lora is None:
        return 0
    return capacity.lora_slot_bytes_per_rank(
        config.model.shape,
        lora.max_loras,
        lora.max_lora_rank,
        config.model.weight_dtype or config.model.dtype,
        config.tensor_parallel_size,
    )


def explicit_num_blocks(config: EngineConfig) -> int | None:
    """Blocks per rank from an explicit budget, or None when the device must be profiled."""
    cache = config.cache
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if cache.kv_cache_bytes is not None:
        return layout(config).blocks_for_budget(cache.kv_cache_bytes)
    return None


def check_one_sequence_fits(config: EngineConfig, num_blocks: int) -> None:
    """Fail at startup, not mid-request, when one max_model_len sequence cannot fit -- with the planner's
    own wording (capacity.one_sequence_error)."""
    source = budget_source(config)
    error = capacity.one_sequence_error(
        num_blocks, config.model.max_model_len, layout(config), source, config.scheduler.max_num_batched_tokens
    )
    if error:
        raise PlanRejected(source, error)


class PlanRejected(InvalidParameter):
    """The KV budget this engine was given (the operator's plan) cannot be honoured: one max_model_len
    sequence does not fit, or weights + activations + the budget exceed the device. The server writes the
    message to the container's termination log so the operator can show it (runtime/server/termination.py)."""


@dataclass(frozen=True)
class DeviceMemory:
    total_bytes: int
    peak_bytes: int  # weights + the profiled forward's peak activations (torch allocator)
    non_torch_bytes: int  # CUDA context, NCCL, other processes


def profiled_num_blocks(config: EngineConfig, memory: DeviceMemory) -> int:
    """No explicit budget: what is left of total * gpu_memory_utilization after the profiled peak."""
    available = (
        int(memory.total_bytes * config.cache.gpu_memory_utilization) - memory.peak_bytes - memory.non_torch_bytes
    )
    num_blocks = max(0, available // layout(config).bytes_per_block)
    logger.info(
        "KV sizing: total %.2f GiB x %.2f - peak %.2f GiB (of which LoRA slots %.2f GiB) - other %.2f GiB -> %d blocks",
        memory.total_bytes / 2**30,
        config.cache.gpu_memory_utilization,
        memory.peak_bytes / 2**30,
        lora_slot_bytes(config) / 2**30,
        memory.non_torch_bytes / 2**30,
        num_blocks,
    )
    return num_blocks


def check_budget_fits_device(config: EngineConfig, memory: DeviceMemory, kv_cache_bytes: int) -> None:
    """A planned --kv-cache-bytes on top of the measured weights and activations must fit the device."""
    needed = memory.peak_bytes + memory.non_torch_bytes + kv_cache_bytes
    if needed <= memory.total_bytes:
        return
    gib = 2**30
    raise PlanRejected(
        budget_source(config),
        f"{budget_source(config)}={kv_cache_bytes} does not fit this GPU: weights+activations "
        f"{memory.peak_bytes / gib:.2f} GiB + other {memory.non_torch_bytes / gib:.2f} GiB + KV "
        f"{kv_cache_bytes / gib:.2f} GiB = {needed / gib:.2f} GiB > {memory.total_bytes / gib:.2f} GiB; the plan "
        f"under-estimated activations: raise engine.activationReserveMiB or lower gpuMemoryUtilization",
    )

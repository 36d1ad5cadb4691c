"""`kvserve plan --calibration CAL.json` with a CPU calibration and no --gpu: the prediction for the CPU server
that calibration measured. Its KV pool is sized as `kvserve serve` sizes it on a CPU: --kv-cache-bytes per
rank, else the runtime's CPU default (config.DEFAULT_CPU_KV_CACHE_BYTES), turned into blocks by the model's KV
layout (runtime/capacity, the arithmetic the engine uses). A GPU is asked for only when the calibration was
measured on one (its step times are that GPU's) or when there is no calibration."""

from __future__ import annotations

import argparse


def calibrated_on_cpu(calibration: dict) -> bool:
    """The calibration's engine ran on the CPU (`kvserve calibrate` records `engine_device`)."""
    return str(calibration.get("engine_device", "")).split(":")[0] == "cpu"


def cpu_plan(settings, shape, kv_cache_bytes: int | None) -> dict:
    """The KV pool `kvserve serve` gives this model on a CPU, in the plan's field names (per rank)."""
    from kvserve.runtime import capacity
    from kvserve.runtime.config import DEFAULT_CPU_KV_CACHE_BYTES

    budget = DEFAULT_CPU_KV_CACHE_BYTES if kv_cache_bytes is None else kv_cache_bytes
    layout = capacity.kv_layout(
        shape, settings.dtype, settings.kv_cache_dtype, settings.block_size, settings.tensor_parallel_size
    )
    num_blocks = layout.blocks_for_budget(budget)
    error = capacity.one_sequence_error(
        num_blocks, settings.max_model_len, layout, "kv_cache_bytes", settings.max_num_batched_tokens
    )
    return {
        "device": "cpu",
        "fits": not error,
        "message": error or "",
        "tensor_parallel_size": settings.tensor_parallel_size,
        "kv_cache_bytes_per_gpu": budget,
        "kv_cache_bytes_source": "--kv-cache-bytes" if kv_cache_bytes is not None else "kvserve serve's CPU default",
        "num_blocks_per_gpu": num_blocks,
        "block_size": settings.block_size,
        "max_tokens_in_kv_per_gpu": (num_blocks - 1) * settings.block_size,  # block 0 is the null block
    }


def format_cpu_plan(plan: dict) -> str:
    gib = 2**30
    return (
        f"CPU server (the calibration's device): KV cache {plan['kv_cache_bytes_per_gpu'] / gib:.2f} GiB per rank "
        f"({plan['kv_cache_bytes_source']}) = {plan['num_blocks_per_gpu']} blocks of {plan['block_size']} tokens, "
        f"TP {plan['tensor_parallel_size']}"
    )


def wanted(args: argparse.Namespace, calibration: dict | None) -> bool:
    """Plan the CPU server: a CPU calibration, no --gpu and no fleet search (which compares catalog GPUs)."""
    return calibration is not None and not args.gpu and calibrated_on_cpu(calibration)

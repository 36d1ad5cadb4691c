"""What one rank holds, measured on its own tensors: the start-up report of every worker (and the uniprocess
executor's one rank), read by the executor's log line, `kvserve bench throughput` and the parallel tests."""

from __future__ import annotations

import os

import msgspec


class RankInfo(msgspec.Struct, frozen=True):
    pid: int
    rank: int  # global rank (TP rank within the stage x stages)
    tp_rank: int  # tensor-parallel rank within its pipeline stage
    stage: int  # pipeline stage (0 without pipelining)
    layers: tuple[int, int]  # [first, end) decoder layers this rank holds
    param_bytes: int
    kv_tensor_bytes: int  # the KV tensor's bytes, views counted once
    kv_cache_bytes: int  # num_blocks x bytes per block (what the budget bought)
    num_blocks: int
    num_kv_heads: int
    kv_head_ids: list[int]
    num_heads: int
    num_host_blocks: int
    kv_block_layout: str  # the attention backend's element order within a KV block (models/attention.py)
    max_rss_bytes: int
    startup_phases: dict[str, float]  # seconds (runtime/startup_phases.py)
    cuda_allocated_bytes: int


def measure_rank(runner, rank: int, pid: int | None = None) -> RankInfo:
    """runner: a ModelRunner. rank: the global rank (the tensor-parallel rank within a pipeline stage is
    model.parallel.rank)."""
    model = runner.model
    stage = model.parallel.stage
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = {t.data_ptr(): t for pair in runner.kv_caches for t in pair}  # views of one tensor; count each once
    return RankInfo(
        pid=os.getpid() if pid is None else pid,
        rank=rank,
        tp_rank=model.parallel.rank,
        stage=stage.index if stage is not None else 0,
        layers=(stage.layers.start, stage.layers.stop) if stage is not None else (0, runner.config.model.num_layers),
        param_bytes=param_bytes,
        kv_tensor_bytes=sum(t.numel() * t.element_size() for t in kv.values()),
        kv_cache_bytes=runner.kv_cache_bytes,
        num_blocks=runner.num_blocks,
        num_kv_heads=model.shard.num_kv_heads,
        kv_head_ids=list(model.shard.kv_head_ids),
        num_heads=model.shard.num_heads,
        num_host_blocks=runner.num_host_blocks,
        kv_block_layout=runner.kv_block_layout,
        max_rss_bytes=_max_rss_bytes(),
        startup_phases=dict(runner.startup_phases),
        cuda_allocated_bytes=_cuda_allocated_bytes(runner),
    )


def _max_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _cuda_allocated_bytes(runner) -> int:
    import torch

    return torch.cuda.memory_allocated(runner.device) if runner.device.type == "cuda" else 0

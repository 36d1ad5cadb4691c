"""Pipeline parallelism, executor side: where each global rank sits (stage, tensor-parallel rank), the process
groups a rank joins, and the engine config its ModelRunner sees.

Rank layout (vLLM's): global rank = stage * TP + tp_rank. The ranks of one stage form its tensor-parallel
group (all-reduces and the logits gather stay inside it); rank (s, r) sends its stage's output hidden states
to rank (s + 1, r). The last stage's tensor-parallel rank 0 samples and is the only rank whose step reply
carries tokens (the executor returns that one).

KV per stage: a stage's runner is given the model config of its own layers (`stage_engine_config`), so the
runner's existing sizing (kv_sizing.layout -> capacity.kv_layout) and allocation count only those layers:
bytes per block = block_size x capacity.stage_kv_bytes_per_token_per_rank. Every rank then takes the minimum
block count of the world (parallel_layers.ParallelContext.all_reduce_min): one scheduler, one block table,
so the stage with the least room per block (the most layers) decides, as capacity.kv_tokens_per_rank plans.
"""

from __future__ import annotations

from dataclasses import replace

from kvserve.runtime import capacity
from kvserve.runtime.config import EngineConfig


def stage_of(config: EngineConfig, rank: int) -> tuple[int, int]:
    """(stage index, tensor-parallel rank within the stage) of a global rank."""
    return divmod(rank, config.tensor_parallel_size)


def output_rank(config: EngineConfig) -> int:
    """The global rank that samples: tensor-parallel rank 0 of the last stage (0 without pipelining)."""
    return (config.pipeline_parallel_size - 1) * config.tensor_parallel_size


def make_stage(config: EngineConfig, rank: int):
    """This rank's PipelineStage (models/pipeline_stage.py), or None with pipeline_parallel_size 1."""
    from kvserve.runtime.models.pipeline_stage import PipelineStage

    pp, tp = config.pipeline_parallel_size, config.tensor_parallel_size
    if pp == 1:
        return None
    index, tp_rank = stage_of(config, rank)
    return PipelineStage(
        index=index,
        size=pp,
        layers=config.parallel.stage_layers[index],
        prev_rank=(index - 1) * tp + tp_rank if index > 0 else None,
        next_rank=(index + 1) * tp + tp_rank if index < pp - 1 else None,
    )


def stage_engine_config(config: EngineConfig, layers: range) -> EngineConfig:
    """The config a stage's runner sizes and allocates its KV cache from: the model's shape restricted to
    this stage's decoder layers (capacity.stage_shape). The model itself is still built from hf_config."""
    model = config.model
    stage_model = replace(model, num_layers=len(layers), shape=capacity.stage_shape(model.shape, layers))
    return replace(config, model=stage_model)


def parallel_context(config: EngineConfig, rank: int):
    """Join this rank's groups (after init_process_group) and return its ParallelContext. Every rank creates
    every stage's group, in the same order, as torch.distributed.new_group requires."""
    import torch.distributed as dist

    from kvserve.runtime.models.parallel_layers import ParallelContext

    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    stage = make_stage(config, rank)
    if stage is None:
        return ParallelContext(rank, tp)
    index, tp_rank = stage_of(config, rank)
    group = None
    if tp > 1:
        groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
        group = groups[index]
    return ParallelContext(tp_rank, tp, group, stage)

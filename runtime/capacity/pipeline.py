"""Pipeline parallelism (issue 28): which layers each stage owns and what one stage's rank allocates.
Layers split by count, earlier stages taking the remainder; `--pipeline-layer-split 31,32,32,31` overrides.
Stage 0 also holds the embedding, the last stage the final norm and LM head."""

from __future__ import annotations

import dataclasses

from kvserve.runtime.capacity.dtypes import DTYPE_BYTES, activation_dtype, kv_cache_dtype
from kvserve.runtime.capacity.shape import ModelShape
from kvserve.runtime.capacity.tensor_parallel import kv_heads_per_rank
from kvserve.runtime.capacity.weights import weight_bytes_per_rank


def stage_layer_ranges(num_layers: int, pp_size: int, layer_split: tuple[int, ...] = ()) -> tuple[range, ...]:
    """Layer index ranges, one per stage. Raises ValueError naming the setting on bad input."""
    if pp_size < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp_size}")
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp_size} exceeds num_hidden_layers={num_layers}")
    if layer_split:
        if len(layer_split) != pp_size:
            raise ValueError(
                f"pipeline_layer_split has {len(layer_split)} entries but pipeline_parallel_size={pp_size}"
            )
        if any(n < 1 for n in layer_split) or sum(layer_split) != num_layers:
            raise ValueError(
                f"pipeline_layer_split={','.join(map(str, layer_split))} must be positive counts summing to "
                f"num_hidden_layers={num_layers}"
            )
        counts = tuple(layer_split)
    else:
        base, extra = divmod(num_layers, pp_size)
        counts = tuple(base + (1 if s < extra else 0) for s in range(pp_size))
    ranges, start = [], 0
    for n in counts:
        ranges.append(range(start, start + n))
        start += n
    return tuple(ranges)


def stage_shape(shape: ModelShape, layers: range) -> ModelShape:
    """The shape of the decoder layers one stage owns, without vocabulary tensors (added by the caller).
    Dense MLP layers of MoE models are taken as the first layers (DeepSeek's first_k_dense_replace)."""
    dense = max(0, min(shape.num_dense_layers, layers.stop) - layers.start)
    sliding = round(shape.num_sliding_layers * len(layers) / shape.num_layers)
    return dataclasses.replace(
        shape, num_layers=len(layers), num_dense_layers=dense, num_sliding_layers=sliding, vocab_size=0
    )


def stage_weight_bytes_per_rank(
    shape: ModelShape, dtype: str, tp_size: int, layers: range, first: bool, last: bool
) -> int:
    """Weight bytes one rank of one stage allocates: its layers, plus the embedding on the first stage and
    the final norm + LM head on the last (a tied LM head is a second copy there: the stages do not share
    memory). Embedding and head stay in the activation dtype, as in parameter_groups_per_rank."""
    body = weight_bytes_per_rank(stage_shape(shape, layers), dtype, tp_size)
    per_elem = DTYPE_BYTES[activation_dtype(dtype)]
    vocab_rows = -(-shape.vocab_size // tp_size)
    table = vocab_rows * shape.hidden_size * per_elem
    # weight_bytes_per_rank counts the final norm once per call; only the last stage keeps it.
    norm = shape.hidden_size * DTYPE_BYTES[activation_dtype(dtype)]
    return body - (0 if last else norm) + (table if first else 0) + (table if last else 0)


def stage_kv_bytes_per_token_per_rank(
    shape: ModelShape, dtype: str, kv_cache_dtype_name: str, tp_size: int, layers: range
) -> int:
    """KV bytes per token one rank of one stage holds: its own layers only."""
    kv = kv_heads_per_rank(shape.num_kv_heads, tp_size)
    return 2 * len(layers) * kv * shape.head_dim * DTYPE_BYTES[kv_cache_dtype(dtype, kv_cache_dtype_name)]


def kv_tokens_per_rank(
    shape: ModelShape,
    dtype: str,
    kv_cache_dtype_name: str,
    tp_size: int,
    pp_size: int,
    gpu_bytes: int,
    layer_split: tuple[int, ...] = (),
) -> tuple[int, int]:
    """(tokens of KV the group can hold, the stage that decides). Every stage must hold every token of a
    sequence, so the stage with the least room per token (the smallest stage) sets the group's"""
    ranges = stage_layer_ranges(shape.num_layers, pp_size, layer_split)
    best: tuple[int, int] | None = None
    for s, layers in enumerate(ranges):
        weights = stage_weight_bytes_per_rank(shape, dtype, tp_size, layers, s == 0, s == pp_size - 1)
        per_token = stage_kv_bytes_per_token_per_rank(shape, dtype, kv_cache_dtype_name, tp_size, layers)
        tokens = max(0, gpu_bytes - weights) // per_token
        if best is None or tokens < best[0]:
            best = (tokens, s)
    assert best is not None
    return best

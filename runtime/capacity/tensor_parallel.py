"""Tensor-parallel shape rules: which TP sizes split a model (runtime/models/sharding.py's layout) and how
many KV heads each rank holds."""

from __future__ import annotations

from kvserve.runtime.capacity.shape import ModelShape


def tp_shape_error(num_heads: int, num_kv_heads: int, intermediate_size: int, tp_size: int) -> str | None:
    """Why this model cannot be split t ways, or None when it can (see runtime/models/sharding.py for
    the layout these rules protect)."""
    t = tp_size
    if t < 1:
        return f"tensor_parallel_size must be >= 1, got {t}"
    if t == 1:
        return None
    valid = valid_tp_sizes(num_heads, num_kv_heads, intermediate_size)
    if num_heads % t:
        return f"num_attention_heads={num_heads} is not divisible by tensor_parallel_size={t} (valid: {valid})"
    if num_kv_heads % t and t % num_kv_heads:
        return (
            f"num_key_value_heads={num_kv_heads} and tensor_parallel_size={t}: one must divide the other, so "
            f"every rank's query heads share whole KV heads (valid: {valid})"
        )
    if intermediate_size % t:
        return f"intermediate_size={intermediate_size} is not divisible by tensor_parallel_size={t} (valid: {valid})"
    return None


def shape_tp_error(shape: ModelShape, tp_size: int) -> str | None:
    """tp_shape_error for a whole model: the experts' width and, for MoE models with dense layers, theirs."""
    error = tp_shape_error(shape.num_attention_heads, shape.num_kv_heads, shape.intermediate_size, tp_size)
    if error is None and shape.num_dense_layers and shape.dense_intermediate_size % tp_size:
        return (
            f"intermediate_size={shape.dense_intermediate_size} (the dense layers' MLP) is not divisible by "
            f"tensor_parallel_size={tp_size}"
        )
    return error


def valid_tp_sizes(num_heads: int, num_kv_heads: int, intermediate_size: int, limit: int = 8) -> list[int]:
    return [
        t
        for t in range(1, min(limit, num_heads) + 1)
        if num_heads % t == 0 and intermediate_size % t == 0 and (num_kv_heads % t == 0 or t % num_kv_heads == 0)
    ]


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """Split when divisible, else one replicated head per rank (t a multiple of num_kv_heads)."""
    return num_kv_heads // tp_size if num_kv_heads % tp_size == 0 else 1

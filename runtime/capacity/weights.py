"""Bytes of weights one rank allocates (as the runtime's tensor-parallel layers shard them, fp8 scales
included) and of its LoRA adapter slots."""

from __future__ import annotations

import math

from kvserve.runtime.capacity.dtypes import (
    DTYPE_BYTES,
    FP8_ACTIVATION_DTYPE,
    FP8_SCALE_BYTES,
    activation_dtype,
    dtype_bytes,
    weight_dtype,
)
from kvserve.runtime.capacity.shape import ModelShape
from kvserve.runtime.capacity.tensor_parallel import kv_heads_per_rank


def parameters_per_rank(shape: ModelShape, tp_size: int) -> int:
    """Elements one rank allocates, as the runtime's tensor-parallel layers shard them. Returns the total;
    `parameter_groups_per_rank` gives the split into quantisable linear weights and the rest."""
    linear, other, _ = parameter_groups_per_rank(shape, tp_size)
    return linear + other


def parameter_groups_per_rank(shape: ModelShape, tp_size: int) -> tuple[int, int, int]:
    """(linear weight elements, other elements, linear output channels) on one rank. Linear weights are
    what fp8 quantises (one scale per output channel); "other" is embeddings, LM head, norms, biases and the
    MoE router, kept in the activation dtype."""
    t, m = tp_size, shape
    heads = m.num_attention_heads // t
    kv = kv_heads_per_rank(m.num_kv_heads, t)
    inter = m.intermediate_size // t
    vocab_rows = math.ceil(m.vocab_size / t)  # vocab-parallel, padded to a multiple of t
    q_out, kv_out = heads * m.head_dim, kv * m.head_dim
    attn_linear = (q_out + 2 * kv_out) * m.hidden_size + m.hidden_size * q_out
    attn_channels = q_out + 2 * kv_out + m.hidden_size
    # Row-parallel biases (o_proj, down_proj) are whole on every rank: added once after the all-reduce.
    attn_other = (
        m.num_layer_norms * m.hidden_size
        + (q_out + 2 * kv_out if m.attention_bias else 0)
        + (m.hidden_size if m.o_proj_bias else 0)
        + (2 * m.head_dim if m.qk_norm else 0)
    )
    experts = max(m.num_experts, 1)
    mlp_linear = experts * 3 * m.hidden_size * inter  # gate, up, down per expert
    mlp_other = experts * (2 * inter + m.hidden_size) if m.mlp_bias else 0
    mlp_channels = experts * (2 * inter + m.hidden_size)
    router = m.hidden_size * m.num_experts  # replicated on every rank
    embeddings = vocab_rows * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    sparse_layers = m.num_layers - m.num_dense_layers  # all of them for dense models (one "expert")
    dense_inter = m.dense_intermediate_size // t
    linear = (
        m.num_layers * attn_linear + sparse_layers * mlp_linear + m.num_dense_layers * 3 * m.hidden_size * dense_inter
    )
    other = m.num_layers * attn_other + sparse_layers * (mlp_other + router) + embeddings + m.hidden_size  # + norm
    channels = (
        m.num_layers * attn_channels
        + sparse_layers * mlp_channels
        + m.num_dense_layers * (2 * dense_inter + m.hidden_size)
    )
    return linear, other, channels


def weight_bytes_per_rank(shape: ModelShape, dtype: str, tp_size: int) -> int:
    """Bytes of weights one rank allocates for `--dtype dtype` (fp8: 1-byte linears + fp32 scales)."""
    linear, other, channels = parameter_groups_per_rank(shape, tp_size)
    w = weight_dtype(dtype)
    if w == "fp8":
        return linear * 1 + channels * FP8_SCALE_BYTES + other * DTYPE_BYTES[FP8_ACTIVATION_DTYPE]
    return (linear + other) * DTYPE_BYTES[w]


def lora_slot_bytes_per_rank(
    shape: ModelShape, max_loras: int, max_lora_rank: int, dtype: str, tp_size: int = 1
) -> int:
    """Device bytes of --max-loras adapter slots on one rank (runtime/lora/batched.LoraSlots), what the
    planner takes off the KV budget: each slot padded to --max-lora-rank, A [rank, in] + B [out, rank] of
    every target module (q/k/v/o/gate/up/down; a sparse MoE layer's experts take no adapter, so only dense
    MLP layers have gate/up/down slots). Column-parallel targets shard B's rows, row-parallel ones A's
    columns; the other factor is whole (runtime/lora/tp_shard.py). The slots are in the activation dtype
    (bf16 under --dtype fp8: the batched delta runs in the activation dtype), which is --dtype otherwise."""
    if max_loras <= 0:
        return 0
    h = shape.hidden_size
    q = shape.num_attention_heads // tp_size * shape.head_dim
    kv = kv_heads_per_rank(shape.num_kv_heads, tp_size) * shape.head_dim
    attention = (h + q) + 2 * (h + kv) + (q + h)  # in + out of q, k, v, o
    if shape.num_experts:
        mlp_layers, inter = shape.num_dense_layers, shape.dense_intermediate_size // tp_size
    else:
        mlp_layers, inter = shape.num_layers, shape.intermediate_size // tp_size
    mlp = 2 * (h + inter) + (inter + h)  # gate, up, down
    per_rank = attention * shape.num_layers + mlp * mlp_layers
    return max_loras * max_lora_rank * per_rank * dtype_bytes(activation_dtype(dtype))

"""Which part of a LoRA adapter one tensor-parallel rank keeps: decided by the checkpoint loader's own
placement plan for the base weight the adapter targets (models/weights.py), so an adapter is always split
exactly like its layer, whatever the fused layout or KV-head replication.

- Column-parallel targets (q/k/v rows of the fused qkv_proj, gate/up rows of gate_up_proj): the layer's
  output rows are split, so B [out, r] keeps this rank's rows of that target (q: its query heads; k/v: its
  KV heads, one head replicated on t / num_kv_heads ranks when num_kv_heads < t; gate/up: its intermediate
  slice) and A [r, in] stays whole. The rank's delta is then exactly its slice of the full delta.
- Row-parallel targets (o_proj, down_proj): the input columns are split, so A keeps this rank's columns and
  B stays whole. B (A_r x_r) is a partial sum that the layer's own all-reduce completes (the delta is added
  before the reduce: RowParallelLinear.lora_delta); the scaling is folded into B, so it applies once.

`full_shapes` gives the model's unsharded (in, out) features per target, which every adapter is checked
against, so all ranks (and the engine core, which checks before any rank sees the adapter) agree.
"""

from __future__ import annotations

import torch

from kvserve.runtime.lora.manager import Key, Shard
from kvserve.runtime.models import weights

# HF target -> (the kvserve parameter holding it, index within the fused parameter or None)
_PARAMETER = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", None),
}


def full_shapes(model, keys) -> dict[Key, tuple[int, int]]:
    """(in, out) features of each (layer, target) in the unsharded model."""
    m = model.config
    hidden, inter = m.hf_config.hidden_size, m.hf_config.intermediate_size
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    shapes = {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    return {key: shapes[key[1]] for key in keys}


def shard_fn(model) -> Shard | None:
    """shard(key, A, B) -> this rank's (A, B) for kvserve's model shard; None when not tensor-parallel."""
    if model.parallel.size == 1:
        return None

    def shard(key: Key, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layer, target = key
        parameter, fused = _PARAMETER[target]
        placements, _ = weights._placements(model, f"layers.{layer}.{parameter}.weight", fused, None)
        if fused is not None:  # column-parallel: B's rows, in the order they sit in the fused parameter
            ordered = sorted(placements, key=lambda p: p[0][0].start)
            return a.contiguous(), torch.cat([b[src[0]] for _, src in ordered]).contiguous()
        (_, src), *_ = placements  # row-parallel: (all rows, this rank's input columns) of the weight
        return (a[src] if src else a).contiguous(), b.contiguous()

    return shard

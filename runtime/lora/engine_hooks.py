"""--enable-lora in the model runner: a LoraManager over kvserve's own model modules (fused qkv_proj and
gate_up_proj take the concatenated q/k/v and gate/up deltas, o_proj and down_proj their own, before their
all-reduce), the adapters of --lora-modules loaded at start-up (every tensor-parallel rank reads them and
keeps its share: lora/tp_shard.py), and the per-token slot ids of one step."""

from __future__ import annotations

import numpy as np
import torch

from kvserve.runtime.config import LoraConfig
from kvserve.runtime.lora import tp_shard
from kvserve.runtime.lora.adapter import load_peft_adapter
from kvserve.runtime.lora.manager import LoraManager


def build_manager(model, lora: LoraConfig, dtype: torch.dtype, device: torch.device) -> LoraManager:
    """Install the hooks (before the CPU linears are packed) and load every adapter into host memory."""
    single, fused = {}, []
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        hidden = attn.o_proj.weight.shape[0]
        qkv = [("q_proj", hidden, attn.q_size), ("k_proj", hidden, attn.kv_size), ("v_proj", hidden, attn.kv_size)]
        fused.append((attn.qkv_proj, i, qkv))
        single[(i, "o_proj")] = attn.o_proj
        if hasattr(mlp, "gate_up_proj"):  # dense MLP (a sparse MoE block's experts take no adapter)
            gate_up = [("gate_proj", hidden, mlp.intermediate), ("up_proj", hidden, mlp.intermediate)]
            fused.append((mlp.gate_up_proj, i, gate_up))
            single[(i, "down_proj")] = mlp.down_proj
    # Start-up adapters are never evicted from host memory: nothing could load them again.
    max_cpu = max(lora.max_cpu_loras, len(lora.modules))
    keys = [*single, *((layer, t) for _, layer, parts in fused for t, _, _ in parts)]
    manager = LoraManager(
        single,
        lora.max_loras,
        lora.max_lora_rank,
        max_cpu,
        fused=fused,
        dtype=dtype,
        device=device,
        shard=tp_shard.shard_fn(model),  # tensor-parallel: this rank's share of each adapter
        full_shapes=tp_shard.full_shapes(model, keys),
    )
    for name, path in lora.modules:
        adapter = load_peft_adapter(name, path, lora.max_lora_rank, manager.targets)
        manager.check(adapter)
        manager.add(adapter)
    return manager


def token_slots(
    manager: LoraManager, lora_names: list[str | None], query_lens: np.ndarray, device: torch.device
) -> torch.Tensor | None:
    """[num_tokens] slot per token of the step's requests (-1: base), or None when none uses an adapter."""
    pinned = {n for n in lora_names if n is not None}
    if not pinned:
        return None
    per_row = np.array([-1 if n is None else manager.activate(n, pinned) for n in lora_names], dtype=np.int64)
    return torch.from_numpy(np.repeat(per_row, query_lens)).to(device)

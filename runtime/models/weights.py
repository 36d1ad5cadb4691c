"""Checkpoint tensors -> a Llama-shaped model's (possibly tensor-parallel) parameters.

HF names are resolved to (our parameter, index within a fused parameter, expert): q/k/v go into the fused
qkv_proj, gate/up into gate_up_proj, and an MoE expert's w1/w3 (Mixtral) or gate/up_proj (Qwen3-MoE) into
row blocks of the experts' 3-D gate_up_proj, w2/down_proj into down_proj. transformers 5's in-memory names
for the experts (3-D `experts.gate_up_proj` / `experts.down_proj`, `mlp.` instead of Mixtral's
`block_sparse_moe.`) load too. For each tensor a placement plan says which slice of the checkpoint tensor
this rank reads and where in the parameter it goes, so a lazy safetensors slice is only ever read for the
rank's rows/columns. Every expected piece must arrive exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from kvserve.runtime.models import fp8

ALL = slice(None)

# HF name suffix -> (our parameter suffix, shard index within the fused parameter)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# One expert's projections (Mixtral: w1 gate, w3 up, w2 down; Qwen3-MoE: gate/up/down_proj)
_EXPERT = {
    "w1": ("gate_up_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "w3": ("gate_up_proj", 1),
    "up_proj": ("gate_up_proj", 1),
    "w2": ("down_proj", None),
    "down_proj": ("down_proj", None),
}


def resolve(name: str) -> tuple[str, int | None, int | None]:
    """HF name (without "model.") -> (parameter name, fused index or None, expert index or None)."""
    name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's checkpoint name for the MoE block
    parts = name.split(".")
    if len(parts) >= 4 and parts[-4] == "experts" and parts[-3].isdigit() and parts[-2] in _EXPERT:
        target, fused = _EXPERT[parts[-2]]
        return ".".join(parts[:-3] + [target]), fused, int(parts[-3])
    fused = _FUSED.get(parts[-2]) if len(parts) >= 2 else None
    if fused is not None:
        return ".".join(parts[:-2] + [fused[0], parts[-1]]), fused[1], None
    return name, None, None


def _key(target: str, fused: int | None, expert: int | None) -> str:
    return target + (f"#{fused}" if fused is not None else "") + (f"@{expert}" if expert is not None else "")


def _is_expert(target: str) -> bool:
    return target.endswith(("experts.gate_up_proj", "experts.down_proj"))


def expected_keys(model) -> list[str]:
    keys = []
    num_experts = model.moe.num_experts if model.moe is not None else 0
    for name, _ in model.named_parameters():
        if name.endswith("experts.gate_up_proj"):
            keys += [_key(name, f, e) for e in range(num_experts) for f in range(2)]
        elif name.endswith("experts.down_proj"):
            keys += [_key(name, None, e) for e in range(num_experts)]
        elif name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            keys += [_key(name, i, None) for i in range(3)]
        elif ".gate_up_proj." in name:
            keys += [_key(name, i, None) for i in range(2)]
        else:
            keys.append(name)
    return keys


def _read(source, index: tuple) -> torch.Tensor:
    return source[index] if index else source[:]


def load_checkpoint(model, weights: Iterable[tuple[str, Any]]) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for hf_name, source in weights:
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name:
            continue
        if name == "lm_head.weight" and model.lm_head is None:
            continue  # tied: the embedding is the head
        target, fused, expert = resolve(name)
        param = params.get(target)
        if param is None:
            raise ValueError(f"unexpected weight {hf_name!r}")
        shape = tuple(source.get_shape()) if hasattr(source, "get_shape") else tuple(source.shape)
        _check_global_shape(model, hf_name, target, fused, expert, shape)
        placements, keys = _placements(model, target, fused, expert)
        for dst_index, src_index in placements:
            if not dst_index and not src_index and tuple(param.shape) != shape:
                raise ValueError(f"weight {hf_name!r} has shape {shape}, expected {tuple(param.shape)}")
            piece = _read(source, src_index)
            dst = param.data[dst_index] if dst_index else param.data
            if tuple(dst.shape) != tuple(piece.shape):
                raise ValueError(
                    f"weight {hf_name!r}: shard of shape {tuple(piece.shape)} does not fit "
                    f"{target} slice {tuple(dst.shape)} (checkpoint shape {shape})"
                )
            if param.dtype == fp8.FP8_DTYPE:  # --dtype fp8: quantise these rows as they are read
                # scales: one per output row, `weight_scale` of a linear, `<name>_scale` of the experts
                fp8.quantize_into(param.data, model.get_buffer(f"{target}_scale"), dst_index, piece)
            else:
                dst.copy_(piece)
        duplicate = loaded.intersection(keys)
        if duplicate:
            raise ValueError(f"weight {hf_name!r} loads {sorted(duplicate)[0]} a second time")
        loaded.update(keys)
    missing = [k for k in expected_keys(model) if k not in loaded]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")


def _check_global_shape(
    model, hf_name: str, target: str, fused: int | None, expert: int | None, shape: tuple[int, ...]
) -> None:
    """The checkpoint tensor's full shape along the split dimension (the rest is checked per slice)."""
    m, cfg = model.config, model.config.hf_config
    if _is_expert(target):
        moe = model.moe
        if expert is not None and not 0 <= expert < moe.num_experts:
            raise ValueError(f"weight {hf_name!r}: expert {expert} out of range (num_experts={moe.num_experts})")
        stacked = expert is None  # transformers 5's 3-D tensor of all experts
        if stacked and (not shape or shape[0] != moe.num_experts):
            raise ValueError(f"weight {hf_name!r} has shape {shape}, expected {moe.num_experts} experts along dim 0")
        if target.endswith("gate_up_proj"):
            dim, want = int(stacked), moe.intermediate_size * (2 if stacked else 1)
        else:
            dim, want = 1 + int(stacked), moe.intermediate_size
    elif fused is not None:
        dim, want = (
            0,
            (
                [m.num_heads * m.head_dim] + [m.num_kv_heads * m.head_dim] * 2
                if "qkv_proj" in target
                else [cfg.intermediate_size] * 2
            )[fused],
        )
    elif target.endswith("o_proj.weight"):
        dim, want = 1, m.num_heads * m.head_dim
    elif target.endswith("down_proj.weight"):
        dim, want = 1, cfg.intermediate_size
    elif target in ("embed_tokens.weight", "lm_head.weight"):
        dim, want = 0, cfg.vocab_size
    else:
        return
    if len(shape) <= dim or shape[dim] != want:
        raise ValueError(f"weight {hf_name!r} has shape {shape}, expected {want} along dim {dim}")


def _placements(model, target: str, fused: int | None, expert: int | None):
    """What this rank copies from one checkpoint tensor: ([(dst_index, src_index)], loaded keys), each index
    a tuple of slices/ints (empty: the whole tensor)."""
    s, hd = model.shard, model.config.head_dim
    if _is_expert(target):
        return _expert_placements(model, target, fused, expert)
    keys = [_key(target, fused, None)]
    if fused is not None and "qkv_proj" in target:
        q_size, kv_size = s.num_heads * hd, s.num_kv_heads * hd
        if fused == 0:  # q_proj: this rank's query heads, contiguous
            start = s.q_head_start * hd
            return [((slice(0, q_size),), (slice(start, start + q_size),))], keys
        base = q_size + (fused - 1) * kv_size  # k or v block of the fused rows
        return [
            ((slice(base + i * hd, base + (i + 1) * hd),), (slice(h * hd, (h + 1) * hd),))
            for i, h in enumerate(s.kv_head_ids)
        ], keys
    if fused is not None:  # dense gate_proj / up_proj
        inter, start = s.intermediate_size, s.intermediate_start
        return [((slice(fused * inter, (fused + 1) * inter),), (slice(start, start + inter),))], keys
    if s.size == 1:
        return [((), ())], keys
    if target.endswith("o_proj.weight"):
        start = s.q_head_start * hd
        return [((), (ALL, slice(start, start + s.num_heads * hd)))], keys
    if target.endswith("down_proj.weight"):
        return [((), (ALL, slice(s.intermediate_start, s.intermediate_start + s.intermediate_size)))], keys
    if target in ("embed_tokens.weight", "lm_head.weight"):
        real = s.vocab_end - s.vocab_start
        model.get_parameter(target).data[real:].zero_()  # padding rows past the real vocabulary
        return [((slice(0, real),), (slice(s.vocab_start, s.vocab_end),))], keys
    return [((), ())], keys  # replicated: norms, routers, row-parallel biases


def _expert_placements(model, target: str, fused: int | None, expert: int | None):
    s, moe = model.shard, model.moe
    inter, start = s.moe_intermediate_size, s.moe_intermediate_start
    mine = slice(start, start + inter)  # this rank's rows of one expert's gate or up, columns of its down
    if expert is not None:  # one expert's 2-D tensor
        if target.endswith("gate_up_proj"):
            return [((expert, slice(fused * inter, (fused + 1) * inter)), (mine,))], [_key(target, fused, expert)]
        return [((expert,), (ALL, mine))], [_key(target, None, expert)]
    experts = range(moe.num_experts)
    if target.endswith("gate_up_proj"):  # [experts, 2 * intermediate, hidden], gate rows then up rows
        full = moe.intermediate_size
        return (
            [
                ((ALL, slice(f * inter, (f + 1) * inter)), (ALL, slice(f * full + start, f * full + start + inter)))
                for f in range(2)
            ],
            [_key(target, f, e) for e in experts for f in range(2)],
        )
    return [((), (ALL, ALL, mine))], [_key(target, None, e) for e in experts]

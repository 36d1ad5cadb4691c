"""Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2/2.5) over a paged KV cache.

Inputs are one flat varlen batch per step: input_ids/positions are [num_tokens]; there is no batch dim.
Q/K/V and gate/up projections are fused into one matmul each; HF checkpoints are split into them at load.
Numerics follow transformers (fp32 RMSNorm, RoPE tables cast to the model dtype) so greedy output matches
`generate` token for token.

Tensor parallelism (Megatron-style, see kvserve.runtime.parallel): with a ParallelContext of size t each rank
holds its query heads and the KV heads they read (column-parallel fused QKV), its slice of the MLP's
intermediate dim (column-parallel gate/up), row-parallel o_proj/down_proj closed by an all-reduce, and a
vocab-parallel embedding and LM head. The loader reads only this rank's rows/columns from the checkpoint.
With t == 1 every layer is the plain nn.Linear/nn.Embedding computation.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.runtime.models import fp8
from kvserve.runtime.models.attention import AttentionMetadata
from kvserve.runtime.parallel.layers import (SINGLE, ColumnParallelLinear, ParallelContext, RowParallelLinear,
                                             VocabParallelEmbedding, lm_head_logits)
from kvserve.runtime.parallel.sharding import ShardSpec, shard_spec


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_model_len, computed as transformers does (inv_freq from
    its rope-init functions, so llama3/linear/dynamic/yarn scaling match), then indexed by position."""

    def __init__(self, hf_config, head_dim: int, max_positions: int, dtype: torch.dtype):
        super().__init__()
        self.hf_config, self.head_dim, self.max_positions, self.dtype = hf_config, head_dim, max_positions, dtype
        device = torch.empty(0).device
        if device.type == "meta":  # built on meta by the loader, which calls build() once materialised
            self.register_buffer("cos", torch.empty(max_positions, head_dim, dtype=dtype), persistent=False)
            self.register_buffer("sin", torch.empty(max_positions, head_dim, dtype=dtype), persistent=False)
        else:
            self.build(device)

    def build(self, device) -> None:
        """(Re)compute the tables on `device` (after the model was created on the meta device)."""
        hf_config, head_dim, max_positions, dtype = self.hf_config, self.head_dim, self.max_positions, self.dtype
        params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
        freqs = torch.arange(max_positions, dtype=torch.float, device="cpu")[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", (emb.cos() * scaling).to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(device=device, dtype=dtype), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions].unsqueeze(1)  # [tokens, 1, head_dim]
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """num_heads / num_kv_heads are this rank's (all of them when not tensor-parallel)."""

    def __init__(self, hf_config, num_heads: int, num_kv_heads: int, head_dim: int, qkv_bias: bool, backend,
                 parallel: ParallelContext = SINGLE):
        super().__init__()
        hidden = hf_config.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = ColumnParallelLinear(hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, hidden, bias=bool(getattr(hf_config, "attention_bias", False)
                                                                       and hf_config.model_type != "qwen2"),
                                        parallel=parallel)
        self.scale = head_dim ** -0.5
        self.backend = backend

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [tokens, heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [tokens, kv_heads, head_dim]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    """intermediate is this rank's slice of the intermediate dim."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, parallel: ParallelContext = SINGLE):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = ColumnParallelLinear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias, parallel=parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, hf_config, shard: ShardSpec, head_dim, qkv_bias, backend, parallel: ParallelContext):
        super().__init__()
        self.self_attn = Attention(hf_config, shard.num_heads, shard.num_kv_heads, head_dim, qkv_bias, backend,
                                   parallel)
        self.mlp = MLP(hf_config.hidden_size, shard.intermediate_size, bool(getattr(hf_config, "mlp_bias", False)),
                       parallel)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(self, x, positions, rotary, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, model_config, backend, parallel: ParallelContext = SINGLE):
        super().__init__()
        cfg = model_config.hf_config
        self.config = model_config
        self.parallel = parallel
        self.shard = shard = shard_spec(model_config.num_heads, model_config.num_kv_heads, cfg.intermediate_size,
                                        cfg.vocab_size, parallel.rank, parallel.size)
        # Qwen2 always has a q/k/v bias; Llama/Mistral only with attention_bias.
        qkv_bias = cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))
        dtype = getattr(torch, model_config.dtype)
        self.embed_tokens = VocabParallelEmbedding(shard.vocab_per_rank, shard.vocab_start, cfg.vocab_size,
                                                   cfg.hidden_size, parallel)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, shard, model_config.head_dim, qkv_bias, backend, parallel)
            for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else ColumnParallelLinear(cfg.hidden_size,
                                                                                  shard.vocab_per_rank, bias=False)
        self.rotary = RotaryEmbedding(cfg, model_config.head_dim, model_config.max_model_len, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [tokens, hidden]
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, positions, self.rotary, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab] float32 logits; None on tensor-parallel ranks other than 0 (only rank 0 samples)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return lm_head_logits(hidden, weight, self.config.vocab_size, self.parallel)

    # -- loading ----------------------------------------------------------------------------------------
    # HF name suffix -> (our parameter suffix, shard index within the fused parameter)
    _FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """weights: (HF name, source) where source is a tensor or a lazy safetensors slice (`get_slice`):
        only this rank's rows/columns are ever read from it, so a rank never materialises a full tensor it
        shards."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, source in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            parts = name.split(".")
            fused = self._FUSED.get(parts[-2]) if len(parts) >= 2 else None
            target = ".".join(parts[:-2] + [fused[0], parts[-1]]) if fused is not None else name
            param = params.get(target)
            if param is None:
                raise ValueError(f"unexpected weight {hf_name!r}")
            shape = tuple(source.get_shape()) if hasattr(source, "get_shape") else tuple(source.shape)
            self._check_global_shape(hf_name, target, fused, shape)
            for dst_start, dst_size, rows, cols in self._shard_plan(target, fused, shape):
                if rows is None and cols is None:
                    if tuple(param.shape) != shape:
                        raise ValueError(f"weight {hf_name!r} has shape {shape}, expected {tuple(param.shape)}")
                    piece = source[:]
                elif cols is None:
                    piece = source[rows[0]:rows[1]]
                else:
                    piece = source[:, cols[0]:cols[1]]
                dst = param.data[dst_start:dst_start + dst_size] if dst_size is not None else param.data
                if tuple(dst.shape) != tuple(piece.shape):
                    raise ValueError(f"weight {hf_name!r}: shard of shape {tuple(piece.shape)} does not fit "
                                     f"{target} slice {tuple(dst.shape)} (checkpoint shape {shape})")
                if param.dtype == fp8.FP8_DTYPE:  # --dtype fp8: quantise these rows as they are read
                    fp8.quantize_into(self.get_submodule(target.rsplit(".", 1)[0]), dst_start, dst_size, piece)
                else:
                    dst.copy_(piece)
            loaded.add(f"{target}#{fused[1]}" if fused is not None else target)
        missing = [n for n in self._expected_weights() if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")

    def _check_global_shape(self, hf_name: str, target: str, fused: tuple[str, int] | None,
                            shape: tuple[int, ...]) -> None:
        """The checkpoint tensor's full shape along the split dimension (the rest is checked per slice)."""
        m, cfg = self.config, self.config.hf_config
        if fused is not None:
            dim, want = 0, ([m.num_heads * m.head_dim] + [m.num_kv_heads * m.head_dim] * 2 if fused[0] == "qkv_proj"
                            else [cfg.intermediate_size] * 2)[fused[1]]
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

    def _shard_plan(self, target: str, fused: tuple[str, int] | None, shape: tuple[int, ...]):
        """What this rank copies from one checkpoint tensor: a list of (dst_row_start, dst_rows, src_rows,
        src_cols) with src_rows/src_cols = (start, end) or None for "all" (dst_rows None: the whole param)."""
        s, hd = self.shard, self.config.head_dim
        if fused is not None and fused[0] == "qkv_proj":
            attn = self.layers[0].self_attn
            if fused[1] == 0:  # q_proj: this rank's query heads, contiguous
                start = s.q_head_start * hd
                return [(0, attn.q_size, (start, start + attn.q_size), None)]
            base = attn.q_size + (fused[1] - 1) * attn.kv_size  # k or v block of the fused rows
            return [(base + i * hd, hd, (h * hd, (h + 1) * hd), None) for i, h in enumerate(s.kv_head_ids)]
        if fused is not None:  # gate_proj / up_proj
            inter = s.intermediate_size
            return [(fused[1] * inter, inter, (s.intermediate_start, s.intermediate_start + inter), None)]
        if s.size == 1:
            return [(0, None, None, None)]
        if target.endswith("o_proj.weight"):
            start = s.q_head_start * hd
            return [(0, None, None, (start, start + s.num_heads * hd))]
        if target.endswith("down_proj.weight"):
            return [(0, None, None, (s.intermediate_start, s.intermediate_start + s.intermediate_size))]
        if target in ("embed_tokens.weight", "lm_head.weight"):
            real = s.vocab_end - s.vocab_start
            self.get_parameter(target).data[real:].zero_()  # padding rows past the real vocabulary
            return [(0, real, (s.vocab_start, s.vocab_end), None)]
        return [(0, None, None, None)]  # replicated: norms, row-parallel biases

    def _expected_weights(self) -> list[str]:
        expected = []
        for name, _ in self.named_parameters():
            if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
                expected += [f"{name}#{i}" for i in range(3)]
            elif ".gate_up_proj." in name:
                expected += [f"{name}#{i}" for i in range(2)]
            else:
                expected.append(name)
        return expected

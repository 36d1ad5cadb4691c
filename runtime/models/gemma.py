"""Gemma 2 and Gemma 3 (text) decoders over the paged KV cache.

What differs from llama.py, each of which breaks token-exactness with transformers when missed:
- RMSNorm multiplies by (1 + weight) in fp32 and casts after (Llama casts first, then multiplies by weight);
- "sandwich" norms: the attention and MLP outputs are normalised before their residual adds (four per layer);
- input embeddings are scaled by sqrt(hidden_size) rounded to the model dtype (the tied LM head is not);
- GeGLU MLP with the tanh-approximate GELU;
- attention scale query_pre_attn_scalar ** -0.5 (not head_dim ** -0.5);
- interleaved sliding-window / global layers (config.layer_types); a sliding layer's query sees itself and
  the sliding_window - 1 keys before it;
- Gemma 2: tanh soft-capping of the attention scores (attn_logit_softcapping) and of the final logits;
- Gemma 3: per-head (1 + w) q/k norms before RoPE, and two RoPE tables -- global layers use
  rope_parameters["full_attention"] (theta 1e6, linear scaling on 4B+), sliding layers
  rope_parameters["sliding_attention"] (rope_local_base_freq 1e4, unscaled). No attention softcap.

Tensor parallelism follows llama.py (column-parallel QKV / gate-up, row-parallel o / down, vocab-parallel
embedding and head); the loader (weights.py) maps the HF names, which are Llama's plus the extra norms.
The forward takes one AttentionMetadata per KV-cache group (see runtime/capacity/kv.py kv_cache_groups):
each layer reads the block table of its group.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.runtime import capacity
from kvserve.runtime.models.attention import AttentionMetadata
from kvserve.runtime.models.parallel_layers import (
    SINGLE,
    ColumnParallelLinear,
    ParallelContext,
    RowParallelLinear,
    VocabParallelEmbedding,
    lm_head_logits,
)
from kvserve.runtime.models.sharding import shard_spec
from kvserve.runtime.models.weights import load_checkpoint


class GemmaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))  # checkpoints store the offset from 1
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


def _rope_inv_freq(params: dict, head_dim: int) -> torch.Tensor:
    """inv_freq for the rope types Gemma checkpoints use: default and linear (inv_freq / factor)."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    base = float(params.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported for Gemma models (default, linear)")
    return inv_freq


class GemmaRotary(nn.Module):
    """cos/sin tables [max_positions, head_dim] per layer type ("full_attention", "sliding_attention"),
    in the model dtype (transformers casts cos/sin before applying them)."""

    def __init__(self, hf_config, head_dim: int, max_positions: int, dtype: torch.dtype):
        super().__init__()
        self.head_dim, self.max_positions, self.dtype = head_dim, max_positions, dtype
        params = getattr(hf_config, "rope_parameters", None) or {}
        nested = "full_attention" in params or "sliding_attention" in params  # Gemma 3: one entry per type
        self.params = {t: dict(params[t] if nested else params) for t in ("full_attention", "sliding_attention")}
        self.tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if torch.empty(0).device.type != "meta":  # the loader builds on meta and calls build() afterwards
            self.build(torch.empty(0).device)

    def build(self, device) -> None:
        positions = torch.arange(self.max_positions, dtype=torch.float, device="cpu")[:, None]
        for layer_type, params in self.params.items():
            freqs = positions * _rope_inv_freq(params, self.head_dim)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self.tables[layer_type] = (
                emb.cos().to(device=device, dtype=self.dtype),
                emb.sin().to(device=device, dtype=self.dtype),
            )

    def forward(self, layer_type: str, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self.tables[layer_type]
        cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [tokens, 1, head_dim]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class GemmaAttention(nn.Module):
    def __init__(
        self,
        hf_config,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_type: str,
        backend,
        parallel: ParallelContext,
        qk_norm: bool,
        softcap: float,
    ):
        super().__init__()
        hidden, bias = hf_config.hidden_size, bool(getattr(hf_config, "attention_bias", False))
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = ColumnParallelLinear(hidden, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = RowParallelLinear(self.q_size, hidden, bias=bias, parallel=parallel)
        self.q_norm = GemmaRMSNorm(head_dim, hf_config.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(head_dim, hf_config.rms_norm_eps) if qk_norm else None
        self.scale = float(hf_config.query_pre_attn_scalar) ** -0.5
        self.layer_type = layer_type
        self.sliding_window = int(hf_config.sliding_window) if layer_type == "sliding_attention" else 0
        self.softcap = float(softcap or 0.0)
        self.backend = backend

    def forward(self, x, positions, rotary: GemmaRotary, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [tokens, heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [tokens, kv_heads, head_dim]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(self.layer_type, positions, q, k)
        o = self.backend.forward(
            q,
            k,
            v,
            kv_cache[0],
            kv_cache[1],
            meta,
            self.scale,
            sliding_window=self.sliding_window,
            softcap=self.softcap,
        )
        return self.o_proj(o.reshape(-1, self.q_size))


class GemmaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, parallel: ParallelContext):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = ColumnParallelLinear(hidden, 2 * intermediate, bias=False)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=False, parallel=parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self, hf_config, shard, head_dim: int, layer_type: str, backend, parallel, qk_norm: bool, attn_softcap: float
    ):
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.self_attn = GemmaAttention(
            hf_config,
            shard.num_heads,
            shard.num_kv_heads,
            head_dim,
            layer_type,
            backend,
            parallel,
            qk_norm,
            attn_softcap,
        )
        self.mlp = GemmaMLP(hidden, shard.intermediate_size, parallel)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, x, positions, rotary, kv_cache, meta):
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), positions, rotary, kv_cache, meta)
        )
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma2ForCausalLM(nn.Module):
    qk_norm = False  # Gemma 3 adds q/k norms
    attn_softcap_supported = True  # Gemma 3's attention never softcaps, whatever the config says

    def __init__(self, model_config, backend, parallel: ParallelContext = SINGLE):
        super().__init__()
        cfg = model_config.hf_config
        self.config, self.parallel, self.moe = model_config, parallel, None
        self.shard = shard = shard_spec(
            model_config.num_heads,
            model_config.num_kv_heads,
            cfg.intermediate_size,
            cfg.vocab_size,
            parallel.rank,
            parallel.size,
        )
        dtype = getattr(torch, model_config.dtype)
        self.layer_types = capacity.gemma_layer_types(_config_dict(cfg))
        attn_softcap = getattr(cfg, "attn_logit_softcapping", None) if self.attn_softcap_supported else None
        self.embed_tokens = VocabParallelEmbedding(
            shard.vocab_per_rank, shard.vocab_start, cfg.vocab_size, cfg.hidden_size, parallel
        )
        # transformers rounds sqrt(hidden) to the weight dtype before scaling (bf16: 3584 -> 59.75); a Python
        # float holding that rounded value gives the same products without a tensor per step.
        self.embed_scale = float(torch.tensor(cfg.hidden_size**0.5, dtype=dtype, device="cpu"))
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, shard, model_config.head_dim, t, backend, parallel, self.qk_norm, attn_softcap)
            for t in self.layer_types
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None  # Gemma ties the LM head to the embedding
        if not getattr(cfg, "tie_word_embeddings", True):
            self.lm_head = ColumnParallelLinear(cfg.hidden_size, shard.vocab_per_rank, bias=False)
        self.final_softcap = float(getattr(cfg, "final_logit_softcapping", None) or 0.0)
        self.rotary = GemmaRotary(cfg, model_config.head_dim, model_config.max_model_len, dtype)
        # Which KV-cache group each layer's block table comes from (the runner allocates the same grouping).
        self.layer_groups = capacity.layer_group_index(
            capacity.kv_cache_groups(capacity.layer_windows(self.layer_types, int(cfg.sliding_window or 0)))
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata | Sequence[AttentionMetadata],
    ) -> torch.Tensor:
        """meta: one AttentionMetadata per KV-cache group, or one shared by all layers (every layer keeps
        its full context then; the sliding layers still mask to their window)."""
        metas = [meta] if isinstance(meta, AttentionMetadata) else list(meta)
        x = self.embed_tokens(input_ids) * self.embed_scale
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, positions, self.rotary, kv_cache, metas[self.layer_groups[i][0] if len(metas) > 1 else 0])
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        head = self.embed_tokens if self.lm_head is None else self.lm_head  # a tied head is the embedding
        logits = lm_head_logits(hidden, head, self.config.vocab_size, self.parallel)
        if logits is not None and self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        load_checkpoint(self, weights)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
    attn_softcap_supported = False


def _config_dict(hf_config) -> dict:
    return {
        "model_type": hf_config.model_type,
        "num_hidden_layers": hf_config.num_hidden_layers,
        "layer_types": getattr(hf_config, "layer_types", None),
        "sliding_window_pattern": getattr(
            hf_config, "_sliding_window_pattern", getattr(hf_config, "sliding_window_pattern", None)
        ),
    }

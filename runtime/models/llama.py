"""Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2/2.5) over a paged KV cache.

Inputs are one flat varlen batch per step: input_ids/positions are [num_tokens]; there is no batch dim.
Q/K/V and gate/up projections are fused into one matmul each; HF checkpoints are split into them at load.
Numerics follow transformers (fp32 RMSNorm, RoPE tables cast to the model dtype) so greedy output matches
`generate` token for token.

Tensor parallelism (Megatron-style, see kvserve.runtime.models.parallel_layers): with a ParallelContext of size t each
rank
holds its query heads and the KV heads they read (column-parallel fused QKV), its slice of the MLP's
intermediate dim (column-parallel gate/up), row-parallel o_proj/down_proj closed by an all-reduce, and a
vocab-parallel embedding and LM head. The loader reads only this rank's rows/columns from the checkpoint.
With t == 1 every layer is the plain nn.Linear/nn.Embedding computation.

Fused CPU ops: when the attention backend says ``fused_cpu_ops`` (the compiled "cpu" backend,
runtime/models/attention_cpu.py), residual-add + RMSNorm, rotary and SiLU-and-mul run as single ops of
kvserve.kernels.cpu_ops on CPU tensors, with the same rounding steps as the torch expressions below (which
stay the fallback: other backends, other devices, mismatched dtypes). The residual stream is then carried
between layers (``forward_fused``) so the add before each norm happens inside the norm op.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.runtime.models.attention import AttentionMetadata
from kvserve.runtime.models.moe import SparseMoeBlock
from kvserve.runtime.models.parallel_layers import (
    SINGLE,
    ColumnParallelLinear,
    ParallelContext,
    RowParallelLinear,
    VocabParallelEmbedding,
    lm_head_logits,
)
from kvserve.runtime.models.registry import moe_shape
from kvserve.runtime.models.sharding import ShardSpec, shard_spec
from kvserve.runtime.models.weights import load_checkpoint

_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _cpu_ops():
    return torch.ops.kvserve_cpu


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

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """kvserve_cpu ops (x on CPU, weight of x's dtype): rms_norm(x), or with ``residual``: residual += x in
        place (rounded as torch's add), then rms_norm(residual)."""
        x = x if x.is_contiguous() else x.contiguous()
        out = torch.empty_like(x)
        if residual is None:
            _cpu_ops().rms_norm(out, x, self.weight, self.eps)
        else:
            _cpu_ops().add_rms_norm(out, residual, x, self.weight, self.eps)
        return out


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

    fused_cpu_ops = False  # set by LlamaForCausalLM when its backend has the compiled CPU ops

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if (
            self.fused_cpu_ops
            and q.is_cpu
            and q.dtype == self.cos.dtype == k.dtype
            and q.stride(-1) == 1
            and k.stride(-1) == 1
            and positions.dtype == torch.int64
        ):
            _cpu_ops().rotary_embedding(positions.contiguous(), q, k, self.cos, self.sin)  # in place
            return q, k
        cos = self.cos[positions].unsqueeze(1)  # [tokens, 1, head_dim]
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """num_heads / num_kv_heads are this rank's (all of them when not tensor-parallel). qk_norm: Qwen3's
    per-head RMSNorm on q and k (over head_dim, before RoPE)."""

    def __init__(
        self,
        hf_config,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        backend,
        parallel: ParallelContext = SINGLE,
        qk_norm: bool = False,
    ):
        super().__init__()
        hidden = hf_config.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = ColumnParallelLinear(hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = RowParallelLinear(
            self.q_size,
            hidden,
            bias=bool(getattr(hf_config, "attention_bias", False) and hf_config.model_type != "qwen2"),
            parallel=parallel,
        )
        self.q_norm = RMSNorm(head_dim, hf_config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, hf_config.rms_norm_eps) if qk_norm else None
        self.scale = head_dim**-0.5
        self.backend = backend

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [tokens, heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [tokens, kv_heads, head_dim]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
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

    fused_cpu_ops = False  # set by LlamaForCausalLM when its backend has the compiled CPU ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused_cpu_ops and gate_up.is_cpu and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
            act = gate_up.new_empty(gate_up.shape[0], self.intermediate)
            _cpu_ops().silu_and_mul(act, gate_up)
            return self.down_proj(act)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        hf_config,
        shard: ShardSpec,
        head_dim,
        qkv_bias,
        backend,
        parallel: ParallelContext,
        mlp: nn.Module,
        qk_norm: bool = False,
    ):
        super().__init__()
        self.self_attn = Attention(
            hf_config, shard.num_heads, shard.num_kv_heads, head_dim, qkv_bias, backend, parallel, qk_norm
        )
        self.mlp = mlp  # dense MLP or a SparseMoeBlock
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(self, x, positions, rotary, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, x, residual, positions, rotary, kv_cache, meta):
        """The same layer with the residual stream carried separately (fused CPU ops): returns (mlp output,
        residual); the caller's next norm adds them. residual None: x is the layer input (first layer)."""
        if residual is None:
            residual = x.clone()  # updated in place below; never alias the embedding output
            h = self.input_layernorm.forward_fused(x)
        else:
            h = self.input_layernorm.forward_fused(x, residual)
        a = self.self_attn(h, positions, rotary, kv_cache, meta)
        return self.mlp(self.post_attention_layernorm.forward_fused(a, residual)), residual


class LlamaForCausalLM(nn.Module):
    """Also the base of the Llama-shaped families (Mixtral, Qwen3, Qwen3-MoE): subclasses switch on QK-norm
    (`qk_norm`) and sparse MLPs (registry.moe_shape decides which layers are sparse)."""

    qk_norm = False
    plain_lm_head = True  # compute_logits is the bare head (no softcap, no scale): greedy may screen it

    def __init__(self, model_config, backend, parallel: ParallelContext = SINGLE):
        super().__init__()
        cfg = model_config.hf_config
        self.config = model_config
        self.parallel = parallel
        self.moe = moe = moe_shape(cfg)
        self.shard = shard = shard_spec(
            model_config.num_heads,
            model_config.num_kv_heads,
            cfg.intermediate_size,
            cfg.vocab_size,
            parallel.rank,
            parallel.size,
            moe_intermediate_size=moe.intermediate_size if moe and moe.sparse_layers else 0,
        )
        # Qwen2 always has a q/k/v bias; Llama/Mistral/Qwen3 only with attention_bias.
        qkv_bias = cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))
        dtype = getattr(torch, model_config.dtype)
        self.embed_tokens = VocabParallelEmbedding(
            shard.vocab_per_rank, shard.vocab_start, cfg.vocab_size, cfg.hidden_size, parallel
        )
        self.layers = nn.ModuleList(
            DecoderLayer(
                cfg, shard, model_config.head_dim, qkv_bias, backend, parallel, self._make_mlp(i), self.qk_norm
            )
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = (
            None
            if self.tie_word_embeddings
            else ColumnParallelLinear(cfg.hidden_size, shard.vocab_per_rank, bias=False)
        )
        self.rotary = RotaryEmbedding(cfg, model_config.head_dim, model_config.max_model_len, dtype)
        # One switch for the fused CPU ops: the backend has them (attention_cpu.CpuAttentionBackend) and the
        # model dtype is one they take; each call still checks the tensors are on CPU.
        self.fused_cpu_ops = bool(getattr(backend, "fused_cpu_ops", False)) and dtype in _FUSED_DTYPES
        if self.fused_cpu_ops:
            self.rotary.fused_cpu_ops = True
            for layer in self.layers:
                if isinstance(layer.mlp, MLP):
                    layer.mlp.fused_cpu_ops = True

    def _make_mlp(self, layer_idx: int) -> nn.Module:
        cfg = self.config.hf_config
        if self.moe is not None and layer_idx in self.moe.sparse_layers:
            return SparseMoeBlock(cfg.hidden_size, self.moe, self.shard.moe_intermediate_size, self.parallel)
        return MLP(cfg.hidden_size, self.shard.intermediate_size, bool(getattr(cfg, "mlp_bias", False)), self.parallel)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [tokens, hidden]
        if self.fused_cpu_ops and x.is_cpu:
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches):
                x, residual = layer.forward_fused(x, residual, positions, self.rotary, kv_cache, meta)
            return self.norm.forward_fused(x, residual) if residual is not None else self.norm.forward_fused(x)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, positions, self.rotary, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab] float32 logits; None on tensor-parallel ranks other than 0 (only rank 0 samples)."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head  # a tied head is the embedding
        return lm_head_logits(hidden, head, self.config.vocab_size, self.parallel)

    # -- loading ----------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """weights: (HF name, source) where source is a tensor or a lazy safetensors slice (`get_slice`):
        only this rank's rows/columns are ever read from it, so a rank never materialises a full tensor it
        shards."""
        load_checkpoint(self, weights)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 and Qwen3-MoE: Llama plus per-head q/k RMSNorm, an explicit head_dim (num_heads * head_dim may
    differ from hidden_size; ModelConfig.head_dim carries it) and no q/k/v bias unless attention_bias.
    Qwen3-MoE's sparse layers come from registry.moe_shape, as Mixtral's do."""

    qk_norm = True

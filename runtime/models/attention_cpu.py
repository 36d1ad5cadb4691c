"""The "cpu" attention backend: the compiled kvserve CPU ops (kvserve.kernels.cpu_ops), the CPU default.

Same contract as TorchAttentionBackend (see attention.py). Per layer: ``store_kv`` writes this step's K/V
into their slots (slot -1 skipped), then ``paged_attention`` reads every query's context straight from the
paged cache through the block table (no gather): decodes, short extends and prefills over a cached prefix,
mixed in one call, GQA heads of one KV head together. Sequences with more than ``gemm_prefill_min_q`` new
tokens are long prefills, where attention is GEMM-shaped: those run one SDPA call each, on this step's own
K/V when the sequence has no cached prefix (nothing to gather) and on its gathered context otherwise (a
copy that is small next to the q_len x ctx work).

Falls back to TorchAttentionBackend for whole calls it does not cover: sliding window or softcap (Gemma),
fp8 KV caches, dtypes other than float32/bfloat16/float16, and non-CPU tensors.

The backend also turns on the fused element-wise ops in runtime/models/llama.py (``fused_cpu_ops``):
residual-add + RMSNorm, in-place rotary and SiLU-and-mul (``KVSERVE_CPU_FUSED_OPS=0`` turns only those off).

Importing this module raises ImportError when the ops do not load, which
attention_backends.get_attention_backend turns into a clear ValueError.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kvserve.kernels import cpu_ops
from kvserve.runtime.models.attention import AttentionMetadata, TorchAttentionBackend

if not cpu_ops.load():
    raise ImportError(cpu_ops.describe())

_ops = torch.ops.kvserve_cpu
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CpuAttentionBackend:
    name = "cpu"
    gemm_prefill_min_q = 48  # q_len above this: one SDPA call for the sequence instead of the paged kernel

    def __init__(self) -> None:
        self._torch = TorchAttentionBackend()
        self.fused_cpu_ops = os.environ.get("KVSERVE_CPU_FUSED_OPS", "1") != "0"

    def _supported(self, q: torch.Tensor, k_cache: torch.Tensor, sliding_window: int, softcap: float) -> bool:
        return (
            not sliding_window
            and not softcap
            and q.device.type == "cpu"
            and q.dtype in _DTYPES
            and k_cache.dtype == q.dtype
            and k_cache.is_contiguous()
        )

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        if k_cache.dtype not in _DTYPES or k.device.type != "cpu" or not k_cache.is_contiguous():
            return self._torch.store_kv(k, v, k_cache, v_cache, meta)
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
        k = k if k.stride(-1) == 1 else k.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
        _ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        if not self._supported(q, k_cache, sliding_window, softcap):
            return self._torch.forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window, softcap)
        self.store_kv(k, v, k_cache, v_cache, meta)
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype)
        limit = self.gemm_prefill_min_q
        _ops.paged_attention(
            out, q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, scale, limit
        )
        if meta.max_seqlen_q > limit:
            start = 0
            for s, (q_len, ctx_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
                if q_len > limit:
                    rows = slice(start, start + q_len)
                    if q_len == ctx_len:  # a fresh prefill: its keys are exactly this step's K/V
                        o = F.scaled_dot_product_attention(
                            q[rows].transpose(0, 1).unsqueeze(0),
                            k[rows].to(q.dtype).transpose(0, 1).unsqueeze(0),
                            v[rows].to(q.dtype).transpose(0, 1).unsqueeze(0),
                            is_causal=True,
                            scale=scale,
                            enable_gqa=True,
                        )
                        out[rows] = o.squeeze(0).transpose(0, 1)
                    else:
                        out[rows] = self._torch._one_sequence(
                            q[rows], k_cache, v_cache, meta.block_tables[s], ctx_len, scale
                        )
                start += q_len
        return out

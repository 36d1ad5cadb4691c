"""Pure-torch references for the Triton kernels (same signatures), written for clarity, not speed.

They define the contract the kernels are tested against and double as a slow fallback:

* KV cache per layer: ``k_cache``, ``v_cache`` of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``;
  the physical slot of a token is ``block_id * block_size + offset``.
* A step's batch is flattened: ``q [num_tokens, num_heads, head_dim]``; sequence ``s`` owns query rows
  ``cu_seqlens_q[s] : cu_seqlens_q[s+1]``; ``seq_lens[s]`` counts all its tokens *including* the new ones, so
  its new tokens sit at positions ``seq_lens[s] - query_len ... seq_lens[s] - 1`` and query ``i`` attends to
  key positions ``<= seq_lens[s] - query_len + i`` (causal), read through ``block_tables[s]``.
* GQA: query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``.
* FP8 cache: ``stored = saturate(x / scale)`` cast to float8; attention reads ``stored * scale``.
"""

from __future__ import annotations

import torch

from .kv_dtypes import is_fp8 as _is_fp8


def _scale_value(scale) -> float:
    if scale is None:
        return 1.0
    if isinstance(scale, torch.Tensor):
        return float(scale.reshape(-1)[0].item())
    return float(scale)


def quantize_to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale=None) -> torch.Tensor:
    """Convert ``x`` to the cache's dtype; float8 caches divide by ``scale`` and saturate first."""
    if not _is_fp8(cache_dtype):
        return x.to(cache_dtype)
    fmax = torch.finfo(cache_dtype).max
    return (x.float() / _scale_value(scale)).clamp(-fmax, fmax).to(cache_dtype)


def dequantize_from_cache(x: torch.Tensor, scale=None) -> torch.Tensor:
    """Cache values as float32 (multiplied by ``scale`` for float8 caches)."""
    if _is_fp8(x.dtype):
        return x.float() * _scale_value(scale)
    return x.float()


def store_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Write each token's ``k[t], v[t]`` (``[num_kv_heads, head_dim]``) to its slot; slot -1 is skipped."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        k_cache[block, offset] = quantize_to_cache(k[t], k_cache.dtype, k_scale)
        v_cache[block, offset] = quantize_to_cache(v[t], v_cache.dtype, v_scale)


def paged_attention_ref(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    cu_seqlens_q,
    max_seqlen_q=None,
    max_seqlen_k=None,
    scale=None,
    k_scale=None,
    v_scale=None,
    out=None,
    sliding_window=0,
    softcap=0.0,
):
    """Causal attention of each sequence's new queries over its whole paged context (fp32 softmax).
    sliding_window W > 0: a query at p sees keys p - W < k <= p only (transformers' rule); softcap > 0:
    scores become softcap * tanh(scores / softcap) after scaling, before masking (Gemma 2)."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if scale is None:
        scale = head_dim**-0.5
    if out is None:
        out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = cu[s], cu[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        context_len = seq_len - q_len
        # Gather this sequence's keys/values through its block table: [seq_len, num_kv_heads, head_dim].
        # With a window, keys before the first query's window are never gathered (their blocks may be null).
        first_key = max(0, context_len - sliding_window + 1) if sliding_window else 0
        pos = torch.arange(first_key, seq_len, device=q.device)
        blocks = block_tables[s, pos // block_size].long()
        keys = dequantize_from_cache(k_cache[blocks, pos % block_size], k_scale)
        values = dequantize_from_cache(v_cache[blocks, pos % block_size], v_scale)
        keys = keys.repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
        values = values.repeat_interleave(group, dim=1)
        qs = q[q_start:q_end].float()  # [q_len, num_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", qs, keys) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = context_len + torch.arange(q_len, device=q.device)
        causal = pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        if sliding_window:
            causal &= pos[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~causal[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, values).to(out.dtype)
    return out


__all__ = ["store_kv_cache_ref", "paged_attention_ref", "quantize_to_cache", "dequantize_from_cache"]

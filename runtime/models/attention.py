"""Paged attention over the KV cache: the metadata the runner builds for it once per step, and the pure-torch
backend (attention_backends.py chooses a backend by name).

Contract (shared with the Triton backend in kvserve.kernels): per layer, k_cache / v_cache are
[num_blocks, block_size, num_kv_heads, head_dim]; the step's new tokens are one flat varlen batch. Each
layer first stores its new K/V at `slot_mapping`, then every query reads its whole context (cached prefix
+ new tokens) from the cache through its block table, causally.

Two per-layer options (Gemma 2/3): `sliding_window` W > 0 keeps, for a query at position p, only keys at
positions p - W < k <= p (transformers' rule: the query and the W - 1 before it); the backend never reads
blocks wholly before the window, so their block-table entries may be the null block (the KV manager frees
them, see core/kv_cache_manager.py). `softcap` > 0 applies `softcap * tanh(scores / softcap)` to the scaled
scores before masking (Gemma 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 = do not store
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: context length including this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with the null block 0
    max_seqlen_q: int
    max_seqlen_k: int
    query_lens_list: list[int]  # host copies, so the torch path never syncs
    seq_lens_list: list[int]
    has_padding_slots: bool = False  # some slot_mapping entries are -1
    k_scale: float = 1.0  # fp8 KV cache scales (1.0 otherwise)
    v_scale: float = 1.0


# The element order of a KV block in the contract above ([block_size, kv_heads, head_dim]); a backend that keeps
# another declares kv_block_layout(kv_dtype, head_dim, block_size) (the CPU backend on AMX: attention_cpu.py).
TOKEN_LAYOUT = "token"


def kv_block_layout(backend, kv_dtype: torch.dtype, head_dim: int, block_size: int) -> str:
    """The element order of `backend`'s KV blocks for these shapes, which the KV tiers' fingerprints and the NIXL
    compatibility hash name (so engines of two orders never share blocks)."""
    declared = getattr(backend, "kv_block_layout", None)
    return declared(kv_dtype, head_dim, block_size) if declared is not None else TOKEN_LAYOUT


class TorchAttentionBackend:
    """Pure-torch paged attention (CPU default). Decodes of one step are batched into one padded SDPA call;
    prefill/extend chunks run one SDPA call each with an offset causal mask."""

    name = "torch"
    decode_group_size = 8

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        slots = meta.slot_mapping
        if meta.has_padding_slots:
            keep = slots >= 0
            k, v, slots = k[keep], v[keep], slots[keep]
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
        if k_cache.element_size() == 1:  # fp8 cache: CPU index_copy_ has no float8 kernel; copy the bytes
            k_cache, v_cache, k, v = (t.view(torch.uint8) for t in (k_cache, v_cache, k, v))
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)

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
        self.store_kv(k, v, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        decode_rows = [s for s, n in enumerate(meta.query_lens_list) if n == 1]
        if len(decode_rows) > 1:
            # Small groups of similar context length: little padding, and each group's gathered K/V stays
            # cache-resident (measured ~3x faster than one padded batch of 32 on a 2-core EPYC).
            decode_rows.sort(key=lambda s: meta.seq_lens_list[s])
            for i in range(0, len(decode_rows), self.decode_group_size):
                self._decode_batch(
                    q,
                    k_cache,
                    v_cache,
                    meta,
                    scale,
                    decode_rows[i : i + self.decode_group_size],
                    out,
                    sliding_window,
                    softcap,
                )
            decode_set = set(decode_rows)
        else:
            decode_set = set()
        start = 0
        for s, (q_len, ctx_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
            if s not in decode_set:
                out[start : start + q_len] = self._one_sequence(
                    q[start : start + q_len],
                    k_cache,
                    v_cache,
                    meta.block_tables[s],
                    ctx_len,
                    scale,
                    sliding_window,
                    softcap,
                )
            start += q_len
        return out

    def _one_sequence(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        ctx_len: int,
        scale: float,
        sliding_window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        q_len, block_size = q.shape[0], k_cache.shape[1]
        # With a window, blocks wholly before the first query's window are never read (they may be null).
        first_key = max(0, ctx_len - q_len - sliding_window + 1) if sliding_window else 0
        first_block = first_key // block_size
        key_start = first_block * block_size
        ids = block_table[first_block : -(-ctx_len // block_size)]
        num_keys = ctx_len - key_start
        # [ctx, kv_heads, head_dim] -> [1, kv_heads, ctx, head_dim]
        keys = k_cache.index_select(0, ids).flatten(0, 1)[:num_keys].to(q.dtype).transpose(0, 1).unsqueeze(0)
        values = v_cache.index_select(0, ids).flatten(0, 1)[:num_keys].to(q.dtype).transpose(0, 1).unsqueeze(0)
        query = q.transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, head_dim]
        if q_len == ctx_len and not sliding_window and not softcap:
            o = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # Query i sits at position ctx_len - q_len + i and sees keys up to there (and, with a window,
            # after q_pos - W).
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
            k_pos = torch.arange(key_start, ctx_len, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if sliding_window:
                mask &= k_pos > q_pos - sliding_window
            if softcap:
                group = query.shape[1] // keys.shape[1]
                keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
                o = _softcapped_attention(query, keys, values, mask, scale, softcap)
            else:
                o = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)

    def _decode_batch(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        rows: list[int],
        out: torch.Tensor,
        sliding_window: int = 0,
        softcap: float = 0.0,
    ) -> None:
        """All single-token queries of the step in one SDPA call, padded to the longest context (the
        longest window with a sliding window). The query heads sharing a KV head ride as extra query rows
        ([B, kv_heads, group, d]), so each K/V element is read once per KV head rather than once per
        query head."""
        block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        num_seqs, group = len(rows), q.shape[1] // num_kv_heads
        token_idx = meta.cu_seqlens_q[rows].long()
        ctx = [meta.seq_lens_list[s] for s in rows]
        # First block each row reads: 0, or the block holding the first key of its window.
        first = [max(0, n - sliding_window) // block_size if sliding_window else 0 for n in ctx]
        num_blocks = max(-(-n // block_size) - f for n, f in zip(ctx, first))
        width = num_blocks * block_size
        dev = q.device
        first_t = torch.tensor(first, device=dev)
        cols = (first_t[:, None] + torch.arange(num_blocks, device=dev)[None, :]).clamp_(
            max=meta.block_tables.shape[1] - 1
        )
        ids = meta.block_tables[rows].gather(1, cols).flatten()
        # index_select on the block dim: one contiguous gather, [B, width, kv_heads, d] -> [B, kv_heads, width, d]
        keys = k_cache.index_select(0, ids).view(num_seqs, width, num_kv_heads, head_dim).to(q.dtype).transpose(1, 2)
        values = v_cache.index_select(0, ids).view(num_seqs, width, num_kv_heads, head_dim).to(q.dtype).transpose(1, 2)
        lens = torch.tensor(ctx, device=dev)
        k_pos = first_t[:, None] * block_size + torch.arange(width, device=dev)[None, :]  # [B, width]
        mask = k_pos < lens[:, None]
        if sliding_window:
            mask &= k_pos >= lens[:, None] - sliding_window
        mask = mask[:, None, None, :]
        query = q[token_idx].view(num_seqs, num_kv_heads, group, head_dim)
        if softcap:
            o = _softcapped_attention(query, keys, values, mask, scale, softcap)
        else:
            o = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)
        out[token_idx] = o.reshape(num_seqs, num_kv_heads * group, head_dim)


def _softcapped_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """transformers' eager order (SDPA cannot softcap): scores in the activation dtype, scaled, capped,
    masked, softmax in fp32 and cast back, times V. query [..., q, d]; keys/values [..., k, d]."""
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, values)

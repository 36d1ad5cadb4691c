"""Paged attention over the block-table KV cache for a mixed (decode + prefill/extend) varlen batch.

Two kernel families, chosen on the host from ``max_seqlen_q`` (no device sync):

* **Unified 2D kernel** (any batch; prefill, chunked prefill / extend with a cached prefix, decode). Grid
  ``(num_q_blocks, num_kv_heads)``. A program owns ``BLOCK_Q`` consecutive query tokens of one sequence and
  *all* query heads that share one KV head, packed into ``BLOCK_M = BLOCK_Q * Q_PER_KV_PAD`` rows, so each
  K/V tile read from the cache feeds every head of the group (GQA reuse) through one ``tl.dot``. The
  program finds its sequence by binary search over ``cu_seqlens_q`` (q-block ``i`` of sequence ``s`` has
  global index ``cu_seqlens_q[s] // BLOCK_Q + s + i``, so ``num_tokens // BLOCK_Q + num_seqs`` programs
  always suffice). It walks KV tiles of ``TILE_N`` positions through the block table (a tile may span
  several physical blocks), applies ``key_pos <= context_len + query_pos``, keeps an online softmax (running
  max, running sum, rescaled accumulator), and stops at the last key its last query can see.
* **Split-K decode (flash-decoding)**, used when every sequence has one query (``max_seqlen_q == 1``) and the
  batch alone cannot fill the GPU. Grid ``(num_seqs, num_kv_heads, num_segments)``: the KV sequence of each
  (sequence, KV head) is cut into ``num_segments`` equal runs of whole tiles; each program runs the online
  softmax over its run for all GQA heads of the KV head (packed as rows) and writes an unnormalized partial
  accumulator with its running max and sum. A reduce kernel (grid ``(num_seqs, num_heads)``) rescales the
  partials by ``exp(m_i - max_i m_i)`` and divides by the merged sum.

Why two kernels rather than one: prefill/extend wants big query tiles for ``tl.dot`` (compute bound); decode
has one query row per head group and is memory bound, so its parallelism must come from the KV length when
``num_seqs * num_kv_heads`` is small (vLLM's unified attention makes the same choice: its 2D kernel plus a 3D
split-KV decode kernel and a segment reduce).

Numerics: scores and softmax in fp32 (``exp2`` with ``log2(e)`` folded into the scale); fp32 inputs use IEEE
``tl.dot`` (no TF32) so fp32 results match the fp32 reference to ~1e-6. Float8 caches are widened and
multiplied by the per-tensor scale on load. Under the Triton interpreter (``TRITON_INTERPRET=1``) all loads
are widened to fp32 first because the 3.9 interpreter mishandles bf16 arithmetic (bf16 ``tl.dot`` returns
garbage), and fp32->bf16 output casts are rounded to nearest even by hand (the interpreter truncates).
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from ._triton_utils import check_device, lazy_jit, next_pow2
from .kv_dtypes import is_fp8
from .kv_store import scale_tensor

_LOG2E = 1.4426950408889634


def _unified_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    k_scale_ptr,
    v_scale_ptr,
    sm_scale_log2,  # softmax scale * log2(e)
    num_seqs,
    window,  # sliding window in tokens (0: full attention)
    softcap,  # score soft-cap (used when USE_SOFTCAP)
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_k_b,
    stride_k_o,
    stride_k_h,
    stride_v_b,
    stride_v_o,
    stride_v_h,
    stride_bt_s,
    Q_PER_KV: tl.constexpr,
    Q_PER_KV_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    IS_FP8: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    INTERPRET: tl.constexpr,
    ROUND_BF16_OUT: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
):
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Binary search for the sequence owning this q-block: the last s with cu[s] // BLOCK_Q + s <= block.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_global:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return  # spare program (the grid is an upper bound)
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_idx = q_block * BLOCK_Q + offs_m // Q_PER_KV_PAD  # query index within the sequence's new tokens
    head_in_group = offs_m % Q_PER_KV_PAD
    q_head = kv_head * Q_PER_KV + head_in_group
    row_mask = (q_idx < q_len) & (head_in_group < Q_PER_KV)
    d_mask = offs_d < HEAD_DIM

    tok = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_q_t + q_head[:, None] * stride_q_h + offs_d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if INTERPRET:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    if IS_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)

    query_pos = context_len + q_idx  # absolute position of each row's query
    # Keys visible to the last query of this block; tiles beyond are skipped entirely.
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    # With a window, tiles wholly before the first query's window are skipped (their blocks may be null).
    first_key = tl.where(window > 0, tl.maximum(context_len + q_block * BLOCK_Q - window + 1, 0), 0)
    first_tile = first_key // TILE_N
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    for t in range(first_tile, num_tiles):
        offs_n = t * TILE_N + tl.arange(0, TILE_N)
        n_mask = (offs_n < kv_end) & (offs_n >= first_key)  # never load before the window: may be null
        phys = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        kt = tl.load(
            k_cache_ptr
            + phys[None, :] * stride_k_b
            + in_block[None, :] * stride_k_o
            + kv_head * stride_k_h
            + offs_d[:, None],
            mask=d_mask[:, None] & n_mask[None, :],
            other=0.0,
        )  # [HEAD_DIM_PAD, TILE_N]
        vt = tl.load(
            v_cache_ptr
            + phys[:, None] * stride_v_b
            + in_block[:, None] * stride_v_o
            + kv_head * stride_v_h
            + offs_d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [TILE_N, HEAD_DIM_PAD]
        if IS_FP8:
            kt = (kt.to(tl.float32) * k_scale).to(q.dtype)
            vt = (vt.to(tl.float32) * v_scale).to(q.dtype)
        elif INTERPRET:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)

        if IEEE_DOT:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        if USE_SOFTCAP:  # softcap * tanh(dot * scale / softcap), tanh via exp2 (clamped: tanh(30) == 1)
            x = tl.minimum(s * (sm_scale_log2 / 1.4426950408889634) / softcap, 30.0)
            s = softcap * (1.0 - 2.0 / (tl.math.exp2(2.0 * x * 1.4426950408889634) + 1.0)) * 1.4426950408889634
        else:
            s = s * sm_scale_log2
        visible = n_mask[None, :] & (offs_n[None, :] <= query_pos[:, None])
        visible = visible & ((offs_n[None, :] > query_pos[:, None] - window) | (window <= 0))
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # fully masked rows stay finite
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE_DOT:
            pv = tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
        else:
            pv = tl.dot(p.to(vt.dtype), vt)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if ROUND_BF16_OUT:  # interpreter only: round to nearest even on the bf16 grid (its cast truncates)
        ob = o.to(tl.uint32, bitcast=True)
        ob = ((ob + 0x7FFF + ((ob >> 16) & 1)) >> 16) << 16
        o = ob.to(tl.float32, bitcast=True)
    tl.store(
        out_ptr + tok[:, None] * stride_o_t + q_head[:, None] * stride_o_h + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def _decode_segment_kernel(
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,  # [num_seqs, num_heads, NUM_SEGMENTS(, HEAD_DIM_PAD)] fp32
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    k_scale_ptr,
    v_scale_ptr,
    sm_scale_log2,
    num_heads,
    window,
    softcap,
    stride_q_t,
    stride_q_h,
    stride_k_b,
    stride_k_o,
    stride_k_h,
    stride_v_b,
    stride_v_o,
    stride_v_h,
    stride_bt_s,
    Q_PER_KV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    IS_FP8: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    INTERPRET: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    # The segments split the tiles the query can see: from the tile of the window's first key (0 without a
    # window); tiles before it are never read (their blocks may be null).
    first_key = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    first_tile = first_key // TILE_N
    num_tiles = tl.cdiv(seq_len, TILE_N) - first_tile
    tiles_per_segment = tl.cdiv(num_tiles, NUM_SEGMENTS)
    tile_start = segment * tiles_per_segment
    if tile_start >= num_tiles:
        return  # empty segment: the reduce kernel ignores it
    tile_end = tl.minimum(tile_start + tiles_per_segment, num_tiles) + first_tile
    tile_start += first_tile

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    h_mask = offs_h < Q_PER_KV
    d_mask = offs_d < HEAD_DIM
    q_head = kv_head * Q_PER_KV + offs_h
    tok = tl.load(cu_seqlens_q_ptr + seq).to(tl.int64)  # the sequence's single query row
    q = tl.load(
        q_ptr + tok * stride_q_t + q_head[:, None] * stride_q_h + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if INTERPRET:
        q = q.to(tl.float32)
    if IS_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM_PAD], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    for t in range(tile_start, tile_end):
        offs_n = t * TILE_N + tl.arange(0, TILE_N)
        n_mask = offs_n < seq_len  # the decode query is the last position: it sees the whole context
        n_mask = n_mask & (offs_n >= first_key)  # ... from the window's first key (never load before it)
        phys = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        kt = tl.load(
            k_cache_ptr
            + phys[None, :] * stride_k_b
            + in_block[None, :] * stride_k_o
            + kv_head * stride_k_h
            + offs_d[:, None],
            mask=d_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        vt = tl.load(
            v_cache_ptr
            + phys[:, None] * stride_v_b
            + in_block[:, None] * stride_v_o
            + kv_head * stride_v_h
            + offs_d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if IS_FP8:
            kt = (kt.to(tl.float32) * k_scale).to(q.dtype)
            vt = (vt.to(tl.float32) * v_scale).to(q.dtype)
        elif INTERPRET:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        if IEEE_DOT:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        if USE_SOFTCAP:  # softcap * tanh(dot * scale / softcap), tanh via exp2 (clamped: tanh(30) == 1)
            x = tl.minimum(s * (sm_scale_log2 / 1.4426950408889634) / softcap, 30.0)
            s = softcap * (1.0 - 2.0 / (tl.math.exp2(2.0 * x * 1.4426950408889634) + 1.0)) * 1.4426950408889634
        else:
            s = s * sm_scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # every segment has >= 1 visible key: finite
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE_DOT:
            pv = tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
        else:
            pv = tl.dot(p.to(vt.dtype), vt)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    row = (seq.to(tl.int64) * num_heads + q_head) * NUM_SEGMENTS + segment  # [BLOCK_H]
    tl.store(part_m_ptr + row, m_i, mask=h_mask)
    tl.store(part_l_ptr + row, l_i, mask=h_mask)
    tl.store(part_acc_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=h_mask[:, None])


def _decode_reduce_kernel(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    num_heads,
    window,
    stride_o_t,
    stride_o_h,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    ROUND_BF16_OUT: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    first_tile = tl.where(window > 0, tl.maximum(seq_len - window, 0) // TILE_N, 0)  # as the split kernel
    num_tiles = tl.cdiv(seq_len, TILE_N) - first_tile
    tiles_per_segment = tl.cdiv(num_tiles, NUM_SEGMENTS)
    num_valid = tl.cdiv(num_tiles, tiles_per_segment)  # segments the split kernel actually wrote

    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = offs_s < num_valid
    row = (seq.to(tl.int64) * num_heads + head) * NUM_SEGMENTS + offs_s
    m = tl.load(part_m_ptr + row, mask=s_mask, other=float("-inf"))
    l_seg = tl.load(part_l_ptr + row, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(s_mask, tl.math.exp2(m - m_max), 0.0)
    denom = tl.sum(w * l_seg, axis=0)
    o = tl.sum(acc * w[:, None], axis=0) / denom
    if ROUND_BF16_OUT:
        ob = o.to(tl.uint32, bitcast=True)
        ob = ((ob + 0x7FFF + ((ob >> 16) & 1)) >> 16) << 16
        o = ob.to(tl.float32, bitcast=True)
    tok = tl.load(cu_seqlens_q_ptr + seq).to(tl.int64)
    tl.store(
        out_ptr + tok * stride_o_t + head * stride_o_h + offs_d, o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM
    )


_unified_attention = lazy_jit(_unified_attention_kernel)
_decode_segment = lazy_jit(_decode_segment_kernel)
_decode_reduce = lazy_jit(_decode_reduce_kernel)

_SM_COUNT: dict = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 16  # interpreter: a stand-in so the heuristic exercises split-K on small CPU batches
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def choose_num_segments(num_seqs: int, num_kv_heads: int, max_seqlen_k: int, tile_n: int, device) -> int:
    """Flash-decoding split count (power of two, 1 = no split) from host-known sizes only.

    Enough (sequence, KV head, segment) programs to give every SM ~2 of them, never more segments than
    would leave each segment fewer than 2 tiles of the longest context, and at most 64.
    """
    base = max(1, num_seqs * num_kv_heads)
    want = math.ceil(2 * _num_sms(device) / base)
    cap = max(1, math.ceil(max_seqlen_k / (2 * tile_n)))
    n = max(1, min(want, cap, 64))
    return 1 << (n - 1).bit_length() if n > 1 else 1


def _prepare(q, k_cache, v_cache, k_scale, v_scale):
    fp8 = is_fp8(k_cache.dtype)
    assert is_fp8(v_cache.dtype) == fp8, "k and v caches must share a dtype family"
    if fp8:
        return True, scale_tensor(k_scale, q.device), scale_tensor(v_scale, q.device)
    assert k_cache.dtype == q.dtype, f"cache dtype {k_cache.dtype} != query dtype {q.dtype} (non-fp8 cache)"
    return False, q, q  # placeholders, never dereferenced


def unified_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    cu_seqlens_q,
    max_seqlen_q,
    max_seqlen_k,
    scale,
    k_scale=None,
    v_scale=None,
    out=None,
    *,
    block_m=None,
    tile_n=None,
    sliding_window=0,
    softcap=0.0,
):
    """Mixed-batch paged attention with the 2D kernel (see module docstring)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    interpret = check_device(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out)
    fp8, ks, vs = _prepare(q, k_cache, v_cache, k_scale, v_scale)
    q_per_kv = num_heads // num_kv_heads
    q_per_kv_pad = next_pow2(q_per_kv)
    if block_m is None:
        # Decode-only batches gain nothing from several query tokens per program.
        block_m = 16 if max_seqlen_q <= 1 else 64
    block_m = max(block_m, q_per_kv_pad, 16)
    block_q = block_m // q_per_kv_pad
    if tile_n is None:
        tile_n = 32
    num_q_blocks = num_tokens // block_q + num_seqs
    _unified_attention[(num_q_blocks, num_kv_heads)](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        ks,
        vs,
        float(scale) * _LOG2E,
        num_seqs,
        int(sliding_window),
        float(softcap or 1.0),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        Q_PER_KV=q_per_kv,
        Q_PER_KV_PAD=q_per_kv_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, next_pow2(head_dim)),
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        IS_FP8=fp8,
        IEEE_DOT=q.dtype == torch.float32,
        INTERPRET=interpret,
        ROUND_BF16_OUT=interpret and out.dtype == torch.bfloat16,
        USE_SOFTCAP=bool(softcap),
    )
    return out


def split_k_decode_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    cu_seqlens_q,
    max_seqlen_k,
    scale,
    k_scale=None,
    v_scale=None,
    out=None,
    *,
    num_segments=None,
    tile_n=None,
    sliding_window=0,
    softcap=0.0,
):
    """Decode-only paged attention (one query per sequence), flash-decoding split-K + reduce."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    num_seqs = seq_lens.shape[0]
    assert num_tokens == num_seqs, "split-K decode needs exactly one query token per sequence"
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    interpret = check_device(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out)
    fp8, ks, vs = _prepare(q, k_cache, v_cache, k_scale, v_scale)
    if tile_n is None:
        tile_n = 64 if block_size >= 64 else 32
    if num_segments is None:
        num_segments = choose_num_segments(num_seqs, num_kv_heads, max_seqlen_k, tile_n, q.device)
    assert num_segments >= 1 and num_segments & (num_segments - 1) == 0, "num_segments must be a power of two"
    q_per_kv = num_heads // num_kv_heads
    head_dim_pad = max(16, next_pow2(head_dim))
    part_acc = torch.empty(num_seqs, num_heads, num_segments, head_dim_pad, dtype=torch.float32, device=q.device)
    part_m = torch.empty(num_seqs, num_heads, num_segments, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    _decode_segment[(num_seqs, num_kv_heads, num_segments)](
        part_acc,
        part_m,
        part_l,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        ks,
        vs,
        float(scale) * _LOG2E,
        num_heads,
        int(sliding_window),
        float(softcap or 1.0),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        Q_PER_KV=q_per_kv,
        BLOCK_H=max(16, next_pow2(q_per_kv)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        NUM_SEGMENTS=num_segments,
        IS_FP8=fp8,
        IEEE_DOT=q.dtype == torch.float32,
        INTERPRET=interpret,
        USE_SOFTCAP=bool(softcap),
    )
    _decode_reduce[(num_seqs, num_heads)](
        out,
        part_acc,
        part_m,
        part_l,
        seq_lens,
        cu_seqlens_q,
        num_heads,
        int(sliding_window),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        TILE_N=tile_n,
        NUM_SEGMENTS=num_segments,
        ROUND_BF16_OUT=interpret and out.dtype == torch.bfloat16,
    )
    return out


def paged_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    cu_seqlens_q,
    max_seqlen_q,
    max_seqlen_k,
    scale,
    k_scale=None,
    v_scale=None,
    out=None,
    *,
    num_segments=None,
    sliding_window=0,
    softcap=0.0,
):
    """Causal paged attention for a flattened mixed batch; returns ``out [num_tokens, num_heads, head_dim]``.

    Arguments follow :func:`kvserve.kernels.reference.paged_attention_ref`. ``max_seqlen_q`` and
    ``max_seqlen_k`` are host ints (upper bounds are fine) used only to pick the kernel and its split count:
    a decode-only batch (``max_seqlen_q == 1``) goes to split-K flash-decoding unless the heuristic (or
    ``num_segments=1``) says one segment per sequence suffices, in which case the 2D kernel runs it.
    Requirements: last dims contiguous; int32/int64 ``block_tables``, ``seq_lens``, ``cu_seqlens_q``;
    ``num_heads`` a multiple of ``num_kv_heads``; non-fp8 caches in ``q``'s dtype.
    ``sliding_window`` W > 0: a query at p sees keys p - W < k <= p, and blocks wholly before the window are
    never read (null entries are fine); ``softcap`` > 0: Gemma 2's tanh cap on the scaled scores.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if out is not None:
        assert out.shape == q.shape and out.stride(-1) == 1
    num_seqs = seq_lens.shape[0]
    if scale is None:
        scale = head_dim**-0.5
    if max_seqlen_q <= 1 and num_tokens == num_seqs:
        tile_n = 64 if k_cache.shape[1] >= 64 else 32
        if num_segments is None:
            # a window bounds the keys a decode reads: split that, not the whole context
            visible = min(max_seqlen_k, sliding_window) if sliding_window else max_seqlen_k
            num_segments = choose_num_segments(num_seqs, num_kv_heads, visible, tile_n, q.device)
        if num_segments > 1:
            return split_k_decode_attention(
                q,
                k_cache,
                v_cache,
                block_tables,
                seq_lens,
                cu_seqlens_q,
                max_seqlen_k,
                scale,
                k_scale,
                v_scale,
                out,
                num_segments=num_segments,
                tile_n=tile_n,
                sliding_window=sliding_window,
                softcap=softcap,
            )
    return unified_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        max_seqlen_q,
        max_seqlen_k,
        scale,
        k_scale,
        v_scale,
        out,
        sliding_window=sliding_window,
        softcap=softcap,
    )


__all__ = ["paged_attention", "unified_attention", "split_k_decode_attention", "choose_num_segments"]

"""Sliding windows and soft-capping in the Triton kernels (2D and split-K decode) and the torch backend,
against the reference, with the block-table entries wholly before each sequence's window pointing at the
null block (what the KV manager leaves there after freeing them). For the kernels the null block is
NaN-poisoned, so loading any key before the window (even masked) shows up as NaN."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import paged_attention
from kvserve.kernels.attention import split_k_decode_attention, unified_attention
from kvserve.kernels.reference import paged_attention_ref
from kvserve.runtime.bench.paged_batch import make_paged_batch, rel_err
from kvserve.runtime.models.attention import AttentionMetadata, TorchAttentionBackend

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _windowed_batch(gen, dtype, block_size, window, q_lens, ctx, heads=(8, 2, 64)):
    b = make_paged_batch(
        q_lens,
        ctx,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=heads[2],
        block_size=block_size,
        dtype=dtype,
        generator=gen,
    )
    b.k_cache[0] = float("nan")  # the null block
    b.v_cache[0] = float("nan")
    for s, c in enumerate(ctx):  # free what the KV manager frees before a step starting at position c
        dead = max(0, c - window + 1) // block_size
        b.block_tables[s, :dead] = 0
    return b


def _ref(b, window, softcap):
    return paged_attention_ref(
        b.q,
        b.k_cache,
        b.v_cache,
        b.block_tables,
        b.seq_lens,
        b.cu_seqlens_q,
        b.max_seqlen_q,
        b.max_seqlen_k,
        b.scale,
        sliding_window=window,
        softcap=softcap,
    )


def _torch_backend(b, window, softcap):
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        cu_seqlens_q=b.cu_seqlens_q,
        seq_lens=b.seq_lens,
        block_tables=b.block_tables,
        max_seqlen_q=b.max_seqlen_q,
        max_seqlen_k=b.max_seqlen_k,
        query_lens_list=(b.cu_seqlens_q[1:] - b.cu_seqlens_q[:-1]).tolist(),
        seq_lens_list=b.seq_lens.tolist(),
    )
    backend = TorchAttentionBackend()
    backend.store_kv = lambda *a: None  # the batch's K/V are already in the cache
    # The torch backend relies on the runner's zero-filled null block and unwritten slots (it pads decode
    # rows with them, masked): give it zeros where the batch has poison.
    k, v = b.k_cache.nan_to_num(0.0).to(b.q.dtype), b.v_cache.nan_to_num(0.0).to(b.q.dtype)
    return backend.forward(b.q, None, None, k, v, meta, b.scale, sliding_window=window, softcap=softcap)


def _check(out, ref, b, dtype, seed, what):
    n = int(b.cu_seqlens_q[-1])
    assert not torch.isnan(out[:n]).any(), f"{what}: NaN -- read a block before the window (seed={seed})"
    err = rel_err(out[:n], ref[:n])
    assert err <= TOL[dtype], f"{what}: rel err {err:.3g} > {TOL[dtype]} (seed={seed})"


@pytest.mark.parametrize(
    "dtype,window,softcap",
    [(torch.float32, 20, 0.0), (torch.float32, 0, 5.0), (torch.bfloat16, 37, 2.0)],
    ids=["w20", "cap5", "bf16-w37-cap2"],
)
def test_mixed_batch_windows_and_softcap(gen, seed, dtype, window, softcap):
    # decodes (one at a block boundary), a fresh prefill longer than the window, extends that start inside
    # and far beyond the window; windows smaller and larger than the 16-token blocks and 32-key tiles
    q_lens, ctx = [1, 1, 1, 50, 9, 33, 1], [0, 63, 200, 0, 100, 96, 21]
    b = _windowed_batch(gen, dtype, 16, window or 10**6, q_lens, ctx)
    ref = _ref(b, window, softcap)
    if window == 0:  # no window: nothing freed -- but the reference must see the same (full) tables
        assert not (b.block_tables[:, 0] == 0).any()
    for what, fn in (("2d", unified_attention), ("auto", paged_attention)):
        out = torch.full_like(b.q, float("nan"))
        fn(
            b.q,
            b.k_cache.to(dtype),
            b.v_cache.to(dtype),
            b.block_tables,
            b.seq_lens,
            b.cu_seqlens_q,
            b.max_seqlen_q,
            b.max_seqlen_k,
            b.scale,
            out=out,
            sliding_window=window,
            softcap=softcap,
        )
        _check(out, ref, b, dtype, seed, what)
    _check(_torch_backend(b, window, softcap), ref, b, dtype, seed, "torch backend")


@pytest.mark.parametrize("window,softcap", [(20, 0.0), (130, 3.0)])
def test_split_k_decode_windows(gen, seed, window, softcap):
    q_lens, ctx = [1] * 5, [0, 31, 200, 300, 129]
    b = _windowed_batch(gen, torch.float32, 16, window, q_lens, ctx)
    ref = _ref(b, window, softcap)
    for segments in (2, 8):
        out = torch.full_like(b.q, float("nan"))
        split_k_decode_attention(
            b.q,
            b.k_cache,
            b.v_cache,
            b.block_tables,
            b.seq_lens,
            b.cu_seqlens_q,
            b.max_seqlen_k,
            b.scale,
            out=out,
            num_segments=segments,
            sliding_window=window,
            softcap=softcap,
        )
        _check(out, ref, b, torch.float32, seed, f"split-K x{segments}")
    _check(_torch_backend(b, window, softcap), ref, b, torch.float32, seed, "torch backend decode")


def test_reference_window_and_cap_change_the_result(gen):
    """The reference's window and cap are live (so the comparisons above can fail)."""
    b = make_paged_batch([1, 40], [300, 0], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, generator=gen)
    full = _ref(b, 0, 0.0)
    assert rel_err(_ref(b, 20, 0.0), full) > 1e-2
    assert rel_err(_ref(b, 0, 1.0), full) > 1e-2
    # window W: the query at p sees exactly W keys -- a window of the whole context changes nothing
    assert rel_err(_ref(b, 301, 0.0), full) == 0

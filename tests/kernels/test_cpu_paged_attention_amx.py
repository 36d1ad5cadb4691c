"""The AMX path of the compiled CPU paged attention (kvkernels/cpu/paged_attention_amx.cpp), on CPUs with AMX
(skipped elsewhere: an AMD EPYC or an older Xeon builds and runs only the AVX-512 kernel).

* bf16 batches of decodes, extends and fresh prefills on scattered, NaN-poisoned blocks (a tile reads the 16 rows of
  a key group, past the context too, so a poisoned row that leaked into a result would show), contexts over the
  256-key chunk so the online softmax crosses chunks mid-sequence, GQA groups 1-20 (decodes of groups over 16 split
  into two row groups), head dims 64 and 128: within bf16 tolerance of the dense oracle;
* the AMX path really runs where it should: items with >= 4 query rows per KV head differ from the AVX-512
  kernel's output (the two round probabilities differently), smaller ones are bit-identical to it;
* shapes AMX does not take (block size 8, head_dim 80) give exactly the AVX-512 kernel's output;
* the result does not depend on the thread count (each worker loads its own tile configuration);
* peaky scores (q scaled by 40) stay finite and match the oracle;
* the AMX block layout (packed_kv): the same batches, their caches packed, every item on AMX (3-row decodes
  included) within tolerance of the oracle, NaN-poisoned slots past each context kept out (the last V tile is
  zeroed there); store_kv's packed write equals packing its token-order write, slot -1 skipped; pack and unpack
  are inverses; a cache the layout cannot take is refused with an error, not read.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import dense_causal_attention

from kvserve.kernels import cpu_ops
from kvserve.runtime.bench.paged_batch import make_paged_batch, rel_err

if not cpu_ops.load():
    pytest.skip(f"compiled CPU ops unavailable: {cpu_ops.unavailable_reason()}", allow_module_level=True)
from kvserve.runtime.models.attention_cpu import amx_usable, pack_kv_blocks, unpack_kv_blocks  # noqa: E402

if not amx_usable():
    pytest.skip("no AMX tiles here (CPU or OS): the AVX-512 kernel alone runs", allow_module_level=True)

ops = torch.ops.kvserve_cpu
BF16_TOL = 1e-2
AMX_MIN_ROWS = 4  # kAmxMinRowsPerKvHead in paged_attention_amx.h


def _run(b, allow_amx: bool, max_q: int = 1 << 30, packed: bool = False) -> torch.Tensor:
    out = torch.full_like(b.q, float("nan"))
    k_cache, v_cache = b.k_cache, b.v_cache
    if packed:
        k_cache, v_cache = (t.contiguous() for t in pack_kv_blocks(k_cache, v_cache))
    ops.paged_attention(
        out, b.q, k_cache, v_cache, b.block_tables, b.seq_lens, b.cu_seqlens_q, b.scale, max_q, -1, allow_amx, packed
    )
    return out


def _batch(gen, heads, block_size, q_lens, ctx):
    num_heads, num_kv_heads, head_dim = heads
    return make_paged_batch(
        q_lens,
        ctx,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.bfloat16,
        generator=gen,
    )


# (heads, kv heads, head_dim): groups 3 (decodes stay on AVX-512), 1, 4, 8, 20 (a decode's 20 rows: two row groups);
# head_dim 96 runs P.V in 32-dim passes (not a multiple of 64). One-group items (decodes, short extends) and
# multi-group items (prefills) take the kernel's two score layouts (S^T = K . Q^T, and S = Q . K^T).
HEADS = [(9, 3, 64), (4, 4, 64), (8, 2, 128), (16, 2, 64), (40, 2, 128), (12, 3, 96)]


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}d{h[2]}")
def test_amx_matches_oracle_and_runs_where_it_should(heads, block_size, seed, gen):
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    # decodes (short, long, at a block end), a 2-token extend, prefills over a prefix that cross the 256-key chunk,
    # fresh prefills (one longer than a 256-row AMX tile for group 3), a 1-token fresh sequence
    q_lens = [1, 1, 1, 2, r(17, 40), r(60, 130), r(90, 140), r(3, 20), 1]
    ctx = [r(1, 40), r(300, 700), block_size * 2 - 1, r(250, 260), r(240, 250), 0, r(200, 400), 0, 0]
    b = _batch(gen, heads, block_size, q_lens, ctx)
    amx, avx = _run(b, True), _run(b, False)
    ref = dense_causal_attention(b)
    assert not torch.isnan(amx).any(), f"unwritten / NaN rows (seed={seed})"
    assert rel_err(amx, ref) <= BF16_TOL, f"AMX rel err {rel_err(amx, ref):.3g} (seed={seed})"
    group = heads[0] // heads[1]
    cu = b.cu_seqlens_q.tolist()
    for s, q_len in enumerate(q_lens[:-1]):  # not the 1-token fresh one: one key gives V exactly on both paths
        rows = slice(cu[s], cu[s + 1])
        same = torch.equal(amx[rows], avx[rows])
        # a sequence's items hold up to 256 // group tokens: its rows per KV head are q_len * group when it fits one
        on_amx = min(q_len, max(1, 256 // group)) * group >= AMX_MIN_ROWS
        assert same != on_amx, f"sequence {s} (q_len {q_len}, group {group}): AMX {'skipped' if same else 'ran'}"


@pytest.mark.parametrize("shape", [(8, 2, 80, 16), (8, 2, 64, 8)], ids=["head-dim-80", "block-size-8"])
def test_shapes_amx_does_not_take_run_the_avx512_kernel(shape, gen):
    num_heads, num_kv_heads, head_dim, block_size = shape
    b = _batch(gen, (num_heads, num_kv_heads, head_dim), block_size, [1, 30, 70], [90, 0, 40])
    assert torch.equal(_run(b, True), _run(b, False))


def test_amx_result_does_not_depend_on_threads(gen):
    b = _batch(gen, (16, 2, 64), 16, [1] * 6 + [40, 90, 7], [100, 200, 300, 31, 64, 5, 0, 120, 260])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(b, True)
        torch.set_num_threads(2)
        two = _run(b, True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_amx_peaky_scores_stay_finite(gen):
    b = _batch(gen, (12, 2, 64), 16, [1, 1, 50, 9], [300, 17, 0, 280])
    b.q.mul_(40)  # scores spread by hundreds: exp(score - max) underflows for most keys
    out = _run(b, True)
    assert torch.isfinite(out).all()
    assert rel_err(out, dense_causal_attention(b)) <= BF16_TOL


@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}d{h[2]}")
def test_packed_layout_matches_oracle(heads, block_size, seed, gen):
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    # as above, plus decodes whose last key opens a block or fills it (the zeroed last V tile at both ends)
    q_lens = [1, 1, 1, 2, r(17, 40), r(60, 130), r(90, 140), r(3, 20), 1, 1, 1]
    ctx = [r(1, 40), r(300, 700), block_size * 2 - 1, r(250, 260), r(240, 250), 0, r(200, 400), 0, 0, 32, 47]
    b = _batch(gen, heads, block_size, q_lens, ctx)
    out = _run(b, True, packed=True)
    assert not torch.isnan(out).any(), f"unwritten / NaN rows (seed={seed})"
    assert rel_err(out, dense_causal_attention(b)) <= BF16_TOL, f"rel err {rel_err(out, dense_causal_attention(b))}"


def test_packed_layout_result_does_not_depend_on_threads(gen):
    b = _batch(gen, (9, 3, 64), 16, [1] * 6 + [40, 90, 7], [100, 200, 300, 31, 64, 5, 0, 120, 260])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(b, True, packed=True)
        torch.set_num_threads(2)
        two = _run(b, True, packed=True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("block_size", [16, 128])
def test_store_kv_packed_equals_packing_the_token_order_write(block_size, gen):
    blocks, kv_heads, head_dim = 7, 3, 64
    # a prefill's runs of slots (whole 16-key groups, and a run from mid-group over a block end), then scattered
    # decode slots and padding (-1): the op's 16-token transposes and its one-token path
    runs = [torch.arange(2 * block_size, 2 * block_size + 40), torch.arange(5 * block_size - 21, 5 * block_size + 3)]
    used = torch.cat(runs)
    rest = torch.tensor([x for x in torch.randperm(blocks * block_size, generator=gen).tolist() if x not in used])
    slots = torch.cat(runs + [rest[:12], torch.full((3,), -1)])
    tokens = slots.shape[0]
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    k_tok = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    v_tok = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    k_packed, v_packed = (t.contiguous() for t in pack_kv_blocks(k_tok, v_tok))
    ops.store_kv(k, v, k_tok, v_tok, slots)
    ops.store_kv(k, v, k_packed, v_packed, slots, True)
    want_k, want_v = pack_kv_blocks(k_tok, v_tok)
    assert torch.equal(k_packed.view(torch.int16), want_k.contiguous().view(torch.int16))
    assert torch.equal(v_packed.view(torch.int16), want_v.contiguous().view(torch.int16))
    back_k, back_v = unpack_kv_blocks(k_packed, v_packed)
    assert torch.equal(back_k.contiguous().view(torch.int16), k_tok.view(torch.int16))
    assert torch.equal(back_v.contiguous().view(torch.int16), v_tok.view(torch.int16))


def test_packed_layout_refuses_what_it_cannot_take(gen):
    b = _batch(gen, (8, 2, 64), 8, [1, 30], [40, 0])  # 8-key blocks: a 16-key K^T tile would straddle two
    out = torch.empty_like(b.q)
    args = (out, b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.cu_seqlens_q, b.scale, 1 << 30, -1)
    with pytest.raises(RuntimeError, match="packed KV cache"):
        ops.paged_attention(*args, True, True)
    with pytest.raises(RuntimeError, match="packed KV cache"):  # fp32 never takes it
        ops.paged_attention(
            *(t.float() if getattr(t, "dtype", None) == torch.bfloat16 else t for t in args), True, True
        )
    with pytest.raises(RuntimeError, match="block_size of 16s"):
        ops.store_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, torch.arange(b.k_new.shape[0]), True)
    assert not ops.packed_kv_usable(64, 8) and not ops.packed_kv_usable(80, 16) and ops.packed_kv_usable(64, 16)

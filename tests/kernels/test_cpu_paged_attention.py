"""The compiled CPU ops (kvserve.kernels.cpu_ops) against the pure-torch paths they replace.

* paged attention: random mixed batches (decodes, fresh prefills, prefills over a cached prefix) on shuffled,
  NaN-poisoned block tables (runtime/bench/paged_batch.py), GQA ratios 1 / 3 / 4, head dims 64/128/80, against the
  block-table-free dense oracle and TorchAttentionBackend. Relative error max|out - ref| / max|ref|:
  fp32 <= 1e-5, bf16 <= 1e-2 (bf16 outputs are rounded once; the torch path rounds scores and probabilities too).
* store_kv: slot -1 rows are skipped and nothing else in the cache changes.
* fused element-wise ops against the eager formulas of runtime/models/llama.py: rotary is bit-identical; RMSNorm
  differs only by the summation order of mean(x^2), SiLU only by the exp polynomial (last-bit differences).
* fallback: a failed build selects the torch backend with one log line.
"""

from __future__ import annotations

import glob
import logging
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import dense_causal_attention

from kvserve.kernels import cpu_ops
from kvserve.runtime.bench.paged_batch import make_paged_batch, rel_err

if not cpu_ops.load():
    pytest.skip(f"compiled CPU ops unavailable: {cpu_ops.unavailable_reason()}", allow_module_level=True)

from kvserve.runtime.models.attention import AttentionMetadata, TorchAttentionBackend  # noqa: E402
from kvserve.runtime.models.attention_cpu import (  # noqa: E402
    AMX_LAYOUT,
    CpuAttentionBackend,
    pack_kv_blocks,
    unpack_kv_blocks,
)

ops = torch.ops.kvserve_cpu
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# GQA 1 / 3 / 4 / 3 (odd head_dim 80) / 8 (two blocks of 4 rows) / 5 (blocks of 4 and 1; head_dim 32: fp32 P.V copy)
HEADS = [(4, 4, 64), (12, 4, 64), (8, 2, 128), (6, 2, 80), (16, 2, 64), (5, 1, 32)]


def _lengths(gen, block_size):
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    q_lens = [1, 1, 1, r(40, 90), r(2, 40), r(17, 33), 1, 1, r(60, 130)]
    ctx = [
        0,
        block_size * r(1, 4) - 1,
        r(200, 500),
        0,
        r(1, 200),
        block_size * r(2, 8),
        r(1, 400),
        block_size,
        r(5, 90),
    ]
    return q_lens, ctx


def _meta(b) -> AttentionMetadata:
    q_lens = (b.cu_seqlens_q[1:] - b.cu_seqlens_q[:-1]).tolist()
    return AttentionMetadata(
        slot_mapping=b.slot_mapping,
        cu_seqlens_q=b.cu_seqlens_q,
        seq_lens=b.seq_lens,
        block_tables=b.block_tables,
        max_seqlen_q=b.max_seqlen_q,
        max_seqlen_k=b.max_seqlen_k,
        query_lens_list=q_lens,
        seq_lens_list=b.seq_lens.tolist(),
        has_padding_slots=bool((b.slot_mapping < 0).any()),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}d{h[2]}")
def test_paged_attention_op_matches_oracle(heads, block_size, dtype, seed, gen):
    num_heads, num_kv_heads, head_dim = heads
    q_lens, ctx = _lengths(gen, block_size)
    b = make_paged_batch(
        q_lens,
        ctx,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        generator=gen,
    )
    out = torch.full_like(b.q, float("nan"))
    ops.paged_attention(out, b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.cu_seqlens_q, b.scale, 1 << 30)
    assert not torch.isnan(out).any(), f"unwritten / NaN rows (seed={seed})"
    err = rel_err(out, dense_causal_attention(b))
    assert err <= TOL[dtype], f"rel err {err:.3g} vs dense oracle (seed={seed})"
    # Long prefills skipped by max_q_len keep their rows untouched (the backend fills them with SDPA).
    out2 = torch.full_like(b.q, float("nan"))
    ops.paged_attention(out2, b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.cu_seqlens_q, b.scale, 48)
    cu = b.cu_seqlens_q.tolist()
    for s, ql in enumerate(q_lens):
        rows = out2[cu[s] : cu[s + 1]]
        assert torch.isnan(rows).all() if ql > 48 else torch.equal(rows, out[cu[s] : cu[s + 1]]), (s, ql, seed)


def test_paged_attention_op_strided_q_and_fp16(gen):
    """q as a view into a fused qkv output (token stride > heads * head_dim), and the fp16 path."""
    b = make_paged_batch(
        [1, 5, 1],
        [33, 7, 0],
        num_heads=12,
        num_kv_heads=4,
        head_dim=64,
        block_size=16,
        dtype=torch.float16,
        generator=gen,
    )
    qkv = torch.randn(b.q.shape[0], (12 + 8) * 64).to(torch.float16)
    q = qkv[:, : 12 * 64].view(-1, 12, 64)
    q.copy_(b.q)
    out = torch.empty_like(b.q)
    ops.paged_attention(out, q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.cu_seqlens_q, b.scale, 1 << 30)
    assert rel_err(out, dense_causal_attention(b)) <= TOL[torch.float16]


@pytest.mark.parametrize("layout", ["token", "amx"])
@pytest.mark.parametrize(
    "sdpa_above", [None, 48, "fresh-39"], ids=["default-split", "sdpa-above-48", "fresh-sdpa-above-39"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(12, 4, 64), (8, 8, 128)], ids=lambda h: f"h{h[0]}kv{h[1]}d{h[2]}")
def test_backend_matches_torch_backend(heads, dtype, sdpa_above, layout, seed, gen):
    """The whole backend (store + paged op + SDPA for long prefills), padding slots included, against the torch
    backend on identical caches: same outputs within tolerance, identical caches afterwards. With the default
    split every prefill here (<= 130 tokens) runs in the paged kernel (on AMX tiles where the CPU has them); with
    sdpa_above=48 the 60-130-token
    ones (fresh and over a cached prefix) take the SDPA branches; with "fresh-39" (bf16 on an AMX CPU) only the
    fresh ones do (AMX CPU, AMX attention off), and the paged kernel skips them. layout "amx": bf16 caches in the
    AMX block layout (AMX CPUs only), compared after unpacking; the paged kernel then takes every prefill here."""
    num_heads, num_kv_heads, head_dim = heads
    q_lens, ctx = _lengths(gen, 16)
    b = make_paged_batch(
        q_lens,
        ctx,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        generator=gen,
        prefilled_new=False,
        pad_tokens=3,
        poison=0.0,
    )
    meta = _meta(b)
    assert meta.has_padding_slots
    kc1, vc1, kc2, vc2 = b.k_cache.clone(), b.v_cache.clone(), b.k_cache.clone(), b.v_cache.clone()
    backend = CpuAttentionBackend()
    if layout == "amx":
        if sdpa_above == "fresh-39" or backend.kv_block_layout(dtype, head_dim, 16) != AMX_LAYOUT:
            pytest.skip("the AMX block layout needs bf16 on an AMX CPU with the AMX path on")
        kc1, vc1 = (t.contiguous() for t in pack_kv_blocks(kc1, vc1))
    else:
        backend.packed_kv = False
    # the AMX path where this CPU has it (test_cpu_paged_attention_amx.py tests it on its own), except in "fresh-39"
    if sdpa_above == "fresh-39":  # an AMX CPU with the AMX attention path off: fresh bf16 prefills go to SDPA
        backend._has_amx, backend.amx_attention = True, False
        backend.PAGED_MAX_FRESH_Q_BF16_AMX = 39
        fresh = [q for q, c in zip(meta.query_lens_list, meta.seq_lens_list) if q == c]
        assert max(fresh) > 39 and (backend.paged_max_fresh_q(dtype) == 39) == (dtype == torch.bfloat16)
    elif sdpa_above is not None:
        backend.PAGED_MAX_Q_FP32 = backend.PAGED_MAX_Q_BF16_DPBF16 = backend.PAGED_MAX_Q_OTHER = sdpa_above
    assert (meta.max_seqlen_q > backend.paged_max_q(dtype, head_dim)) == (sdpa_above == 48)
    out_cpu = backend.forward(b.q, b.k_new, b.v_new, kc1, vc1, meta, b.scale)
    out_ref = TorchAttentionBackend().forward(b.q, b.k_new, b.v_new, kc2, vc2, meta, b.scale)
    if layout == "amx":
        assert backend._packs(kc1)
        kc1, vc1 = unpack_kv_blocks(kc1, vc1)
    assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2), "store_kv wrote different caches"
    n = int(b.cu_seqlens_q[-1])
    err = rel_err(out_cpu[:n], out_ref[:n])
    assert err <= TOL[dtype], f"rel err {err:.3g} vs torch backend (seed={seed})"
    assert rel_err(out_cpu[:n], dense_causal_attention(b)[:n]) <= TOL[dtype], seed


def test_paged_kernel_limit_per_dtype(monkeypatch):
    """Where the paged kernel hands long prefills to SDPA: the measured crossovers (attention_cpu docstring)."""
    backend = CpuAttentionBackend()
    assert backend.paged_max_q(torch.float32, 64) == 512
    assert backend.paged_max_q(torch.float16, 64) == 48
    backend._has_dpbf16 = True
    assert backend.paged_max_q(torch.bfloat16, 64) == 1024
    assert backend.paged_max_q(torch.bfloat16, 80) == 48  # head_dim not a multiple of 32: no dpbf16 path
    backend._has_dpbf16 = False
    assert backend.paged_max_q(torch.bfloat16, 64) == 48
    backend._has_amx, backend.amx_attention = True, False  # AMX CPU, AMX attention off: fresh bf16 prefills
    assert backend.paged_max_fresh_q(torch.bfloat16) == 56  # go to SDPA (AMX tiles) from 56 tokens
    backend.amx_attention = True  # the paged kernel's AMX path beats SDPA on them: no split
    assert backend.paged_max_fresh_q(torch.bfloat16) == -1
    backend.amx_attention = False
    assert backend.paged_max_fresh_q(torch.float32) == backend.paged_max_fresh_q(torch.float16) == -1
    backend._has_amx = False
    assert backend.paged_max_fresh_q(torch.bfloat16) == -1


def test_paged_op_skips_only_long_fresh_prefills(gen):
    """max_fresh_q_len: a fresh prefill above it is left untouched (the backend runs it through SDPA); a prefill
    chunk of the same length over a cached prefix, and a decode, are still computed."""
    b = make_paged_batch(
        [40, 40, 1],
        [0, 32, 49],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        generator=gen,
        prefilled_new=True,
    )
    out = torch.full_like(b.q, 7.0)
    torch.ops.kvserve_cpu.paged_attention(
        out, b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.cu_seqlens_q, b.scale, 512, 32
    )
    ref = dense_causal_attention(b)
    assert torch.all(out[:40] == 7.0), "the fresh 40-token prefill above the fresh limit was computed"
    assert rel_err(out[40:81], ref[40:81]) <= TOL[torch.float32]


def test_store_kv_skips_padding_slots(gen):
    b = make_paged_batch(
        [3, 1],
        [5, 16],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=8,
        generator=gen,
        prefilled_new=False,
        pad_tokens=2,
        poison=-7.0,
    )
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    ops.store_kv(b.k_new, b.v_new, kc, vc, b.slot_mapping)
    slots = b.slot_mapping
    keep = slots >= 0
    flat_k, flat_v = kc.view(-1, 2, 64), vc.view(-1, 2, 64)
    assert torch.equal(flat_k[slots[keep]], b.k_new[keep]) and torch.equal(flat_v[slots[keep]], b.v_new[keep])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots[keep]] = False
    assert torch.equal(flat_k[untouched], b.k_cache.view(-1, 2, 64)[untouched])
    with pytest.raises(RuntimeError, match="out of range"):
        ops.store_kv(b.k_new, b.v_new, kc, vc, torch.full_like(slots, 10**6))


def _rms_ref(x, w, eps):  # runtime/models/llama.py RMSNorm.forward
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _ulps(a, b):
    """Largest difference in units of the dtype's last place (bf16/fp16/fp32), element-wise."""
    spacing = torch.finfo(a.dtype).eps * torch.maximum(a.float().abs(), b.float().abs()).clamp_min(1e-30)
    return ((a.float() - b.float()).abs() / spacing).max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_and_add_rms_norm(dtype, gen):
    x = torch.randn(37, 768, generator=gen).to(dtype)
    res = torch.randn(37, 768, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(768, generator=gen)).to(dtype)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-6)
    ref = _rms_ref(x, w, 1e-6)
    # fp32: the sum order of mean(x^2) may move rsqrt by an ulp; bf16: that can flip one rounding (1 ulp).
    assert _ulps(out, ref) <= (4 if dtype == torch.float32 else 1.01)
    if dtype == torch.bfloat16:
        assert (out != ref).float().mean().item() < 0.02
    r2 = res.clone()
    ops.add_rms_norm(out, r2, x, w, 1e-5)
    h = res + x
    assert torch.equal(r2, h), "the residual must be exactly torch's add"
    assert _ulps(out, _rms_ref(h, w, 1e-5)) <= (4 if dtype == torch.float32 else 1.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 48])  # 48: half is not a multiple of 16 -> the scalar loop
def test_rotary_in_place_is_bit_identical(dtype, head_dim, gen):
    from types import SimpleNamespace

    from kvserve.runtime.models.llama import RotaryEmbedding, _rotate_half

    rot = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), head_dim, 512, dtype)
    positions = torch.randint(0, 512, (29,), generator=gen)
    qkv = torch.randn(29, (12 + 8) * head_dim, generator=gen).to(dtype)
    q_end, k_end = 12 * head_dim, 16 * head_dim
    # strided views, as in Attention
    q, k = qkv[:, :q_end].view(29, 12, head_dim), qkv[:, q_end:k_end].view(29, 4, head_dim)
    cos, sin = rot.cos[positions].unsqueeze(1), rot.sin[positions].unsqueeze(1)
    q_ref, k_ref = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    v_before = qkv[:, k_end:].clone()
    ops.rotary_embedding(positions, q, k, rot.cos, rot.sin)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(qkv[:, k_end:], v_before), "v must be untouched"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_silu_and_mul(dtype, gen):
    x = (3 * torch.randn(41, 2 * 2048, generator=gen)).to(dtype)
    out = torch.empty(41, 2048, dtype=dtype)
    ops.silu_and_mul(out, x)
    gate, up = x.split(2048, dim=-1)
    ref = F.silu(gate) * up
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    else:
        assert _ulps(out, ref) <= 1.01 and (out != ref).float().mean().item() < 0.01


def test_failed_build_falls_back_to_torch(monkeypatch, caplog):
    """A machine without a compiler: the loader reports False with the reason, get_attention_backend('cpu') says
    why, and the CPU default is 'torch' with one log line."""
    import kvserve.runtime.config as config
    import kvserve.runtime.models.attention_backends as attention

    def boom():
        raise RuntimeError("Error building extension 'kvserve_cpu_ops': c++: command not found")

    monkeypatch.setattr(cpu_ops, "_build", boom)
    monkeypatch.setattr(cpu_ops, "_STATE", {})
    monkeypatch.setattr(config, "_DEFAULT_CPU", [])
    monkeypatch.delitem(sys.modules, "kvserve.runtime.models.attention_cpu", raising=False)
    assert cpu_ops.load() is False and "command not found" in cpu_ops.unavailable_reason()
    with caplog.at_level(logging.INFO, logger="kvserve.runtime.config"):
        assert config.default_cpu_backend() == "torch"
        assert config.default_cpu_backend() == "torch"
    lines = [r.getMessage() for r in caplog.records if r.name == "kvserve.runtime.config"]
    assert len(lines) == 1 and "'torch'" in lines[0] and "command not found" in lines[0], lines
    with pytest.raises(ValueError, match="'cpu' is unavailable"):
        attention.get_attention_backend("cpu")
    assert type(attention.get_attention_backend("torch")).__name__ == "TorchAttentionBackend"
    monkeypatch.undo()
    assert type(attention.get_attention_backend("cpu")).__name__ == "CpuAttentionBackend"


def test_working_build_selects_cpu_with_one_line(monkeypatch, caplog):
    import kvserve.runtime.config as config

    monkeypatch.setattr(config, "_DEFAULT_CPU", [])
    with caplog.at_level(logging.INFO, logger="kvserve.runtime.config"):
        assert config.default_cpu_backend() == "cpu"
        config.default_cpu_backend()
    lines = [r.getMessage() for r in caplog.records if r.name == "kvserve.runtime.config"]
    assert len(lines) == 1 and "'cpu'" in lines[0] and cpu_ops.isa_tag() in lines[0], lines


def test_isa_tag_and_name():
    assert cpu_ops.isa_tag({"avx2"}) == "avx2"
    assert cpu_ops.isa_tag({"avx512f", "avx512bw", "avx512_bf16"}) == "avx512bf16"
    assert cpu_ops.isa_tag(set()) == "generic"
    a, b = cpu_ops.extension_name({"avx2", "fma"}), cpu_ops.extension_name({"avx2"})
    assert a != b and a.startswith("kvserve_cpu_ops_avx2_")


def test_name_changes_with_the_sources(tmp_path, monkeypatch):
    """Another checkout's sources (one byte or one file different) build under another name, so two trees on one
    machine never rebuild over each other's library."""
    import shutil

    for path in glob.glob(os.path.join(os.path.dirname(cpu_ops.__file__), "cpu", "*")):
        shutil.copy(path, tmp_path)
    monkeypatch.setattr(cpu_ops, "_SRC_DIR", str(tmp_path))
    same = cpu_ops.extension_name({"avx2"})
    with open(tmp_path / "rms_norm.cpp", "a") as f:
        f.write("\n// edited\n")
    edited = cpu_ops.extension_name({"avx2"})
    (tmp_path / "extra.cpp").write_text("// another op\n")
    assert len({same, edited, cpu_ops.extension_name({"avx2"})}) == 3


# -- end to end: LLM(attention_backend="cpu") against the pure-torch path ------------------------------------
def _generate(model_dir, prompts, backend, max_new=8, **kw):
    from kvserve.runtime import LLM, SamplingParams

    llm = LLM(
        model_dir, max_model_len=160, num_kv_blocks=64, block_size=16, attention_backend=backend, device="cpu", **kw
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True, logprobs=1),
        use_tqdm=False,
    )
    layout = llm.engine.config.cache.kv_block_layout
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs], layout


def _prompts(seed: int, vocab: int):
    import random

    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(20)]  # a cached block of 16 -> prefix hits
    return [shared + [rng.randrange(3, vocab) for _ in range(n)] for n in (1, 13, 70)] + [[5], [7, 9, 11]]


@pytest.mark.parametrize(
    "name,dtype,kw",
    [
        ("llama_gqa", "float32", dict(max_num_batched_tokens=24)),  # chunked prefill: extends over a cached prefix
        ("qwen2_qkv_bias", "float32", dict()),
        ("llama_gqa", "bfloat16", dict()),
        # head_dim 64, GQA 3 (SmolLM2's): on an AMX CPU the AMX block layout, chunked extends and 3-row decodes
        ("llama_gqa_d64", "bfloat16", dict(max_num_batched_tokens=24)),
    ],
    ids=["llama_gqa-fp32-chunked", "qwen2-fp32", "llama_gqa-bf16", "llama_gqa-d64-bf16-chunked"],
)
def test_engine_cpu_backend_matches_torch(tmp_path, name, dtype, kw):
    from kvserve_testing import TEST_MODEL_CONFIGS

    from kvserve.runtime.models.attention_cpu import AMX_LAYOUT, amx_usable
    from kvserve.runtime.models.synthetic import make_random_model_dir

    d64 = name == "llama_gqa_d64"
    arch, kwargs = TEST_MODEL_CONFIGS["llama_gqa" if d64 else name]
    if d64:
        kwargs = dict(kwargs, hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=64)
    make_random_model_dir(str(tmp_path), arch, seed=1234, dtype=dtype, **kwargs)
    prompts = _prompts(3, 512)
    exp_tokens, exp_lp, _ = _generate(str(tmp_path), prompts, "torch", **kw)
    got_tokens, got_lp, layout = _generate(str(tmp_path), prompts, "cpu", **kw)
    assert layout == (AMX_LAYOUT if d64 and amx_usable() else "token")
    if dtype == "float32":
        assert got_tokens == exp_tokens
    else:  # bf16: the first tokens agree; logprobs of the chosen tokens within 0.1 nats where tokens agree
        assert [t[0] for t in got_tokens] == [t[0] for t in exp_tokens]
    for gt, et, gl, el in zip(got_tokens, exp_tokens, got_lp, exp_lp):
        for i, (a, b) in enumerate(zip(gt, et)):
            if a != b:
                break
            assert abs(gl[i][a].logprob - el[i][b].logprob) <= (1e-3 if dtype == "float32" else 0.1)


def test_fused_ops_switch(tmp_path):
    """The cpu backend turns the fused ops on in the Llama model; the torch backend leaves them off."""
    from kvserve_testing import TEST_MODEL_CONFIGS

    from kvserve.runtime.config import load_model_config
    from kvserve.runtime.models.attention_backends import get_attention_backend
    from kvserve.runtime.models.loader import build_meta_model
    from kvserve.runtime.models.synthetic import make_random_model_dir

    arch, kwargs = TEST_MODEL_CONFIGS["llama_gqa"]
    make_random_model_dir(str(tmp_path), arch, seed=1, dtype="float32", **kwargs)
    mc = load_model_config(str(tmp_path), "float32", 64)
    on = build_meta_model(mc, get_attention_backend("cpu"))
    off = build_meta_model(mc, get_attention_backend("torch"))
    assert on.fused_cpu_ops and on.rotary.fused_cpu_ops and on.layers[0].mlp.fused_cpu_ops
    assert not off.fused_cpu_ops and not off.rotary.fused_cpu_ops and not off.layers[0].mlp.fused_cpu_ops


@pytest.mark.parametrize("vocab", [32000, 7, 16, 1000003 % 4099])
def test_greedy_argmax_equals_torch(vocab, gen):
    """First maximum on ties (within a SIMD lane and across lanes), the first NaN when a row has one, all -inf
    rows, a strided row view; torch.argmax is the reference."""
    logits = torch.randn(37, vocab, generator=gen)
    logits[1] = 0.0  # all tied: index 0
    logits[2, -1] = logits[2, 0] = logits[2].max() + 1  # the first of two maxima
    if vocab > 20:
        logits[3, 17] = logits[3, 1] = logits[3].max() + 1  # two lanes hold the maximum: the smaller index
    logits[4, vocab // 2] = float("nan")
    logits[5, :] = float("nan")
    logits[6, :] = float("-inf")
    logits[7, vocab - 1] = float("inf")
    logits[8] = logits[8].round()  # many ties at the top
    for x in (logits, torch.randn(5, vocab * 2, generator=gen)[:, :vocab]):
        assert torch.equal(ops.greedy_argmax(x), x.argmax(dim=-1))
        for dtype in (torch.bfloat16, torch.float16):  # widened in registers: the argmax of the same values
            narrow = x.to(dtype)
            assert torch.equal(ops.greedy_argmax(narrow), narrow.float().argmax(dim=-1))


def test_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch, caplog):
    """A lock left by a build that was killed would make torch's FileBaton wait forever at every later start."""
    import time as _time

    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = os.path.join(_get_build_directory("kvserve_cpu_ops_test", False), "lock")
    open(lock, "w").close()
    assert not cpu_ops.clear_stale_build_lock("kvserve_cpu_ops_test")  # a build in progress: keep waiting
    assert os.path.exists(lock)
    later = _time.time() + cpu_ops.STALE_LOCK_SECONDS + 1
    with caplog.at_level("WARNING", logger="kvserve.kernels"):
        assert cpu_ops.clear_stale_build_lock("kvserve_cpu_ops_test", now=later)
    assert not os.path.exists(lock) and "stale build lock" in caplog.text
    assert not cpu_ops.clear_stale_build_lock("kvserve_cpu_ops_test", now=later)  # nothing left to remove

"""No value-dependent slowdowns in the compiled CPU ops (issue 39, scope 3).

Peaky attention (scores spread by more than ~87) makes exp(score - max) land in fp32's subnormal range; on x86
every instruction that produces or consumes a subnormal then takes a microcode assist. Measured on this
machine's Sapphire Rapids core before the fix, one thread, decode of 32 sequences x 512 keys: bf16 1.15 ms
flat vs 10.5 ms peaky, fp32 1.65 vs 7.2 ms. The ops now set flush-to-zero / denormals-are-zero inside every
parallel region (cpu_vec.h FlushDenormalsScope) and the vector exp returns 0 below ln(FLT_MIN).

* every worker thread flushes: subnormal inputs read as zero on all rows of a 2-thread parallel_for (a
  deterministic check, no clock);
* the calling thread's floating-point mode is restored after each op;
* a decode step of a random Llama whose q/k projections are scaled up (peaky attention) takes at most 1.2x
  the step of the same model unscaled, fp32 and bf16 (min of interleaved steps, one thread: the machine is
  shared, and the minimum is the run least disturbed by other processes);
* the peaky outputs still match the pure-torch oracle.
"""

from __future__ import annotations

import platform
import random
import shutil
import time

import pytest
import torch

from kvserve.kernels import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason="compiled CPU ops unavailable")
x86_only = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="MXCSR is x86's")

SUBNORMAL = 1e-39  # below FLT_MIN = 1.18e-38


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _assert_mode_restored():
    """The caller's thread still computes with subnormals (FTZ/DAZ were not left on)."""
    x = torch.full((4,), SUBNORMAL)
    assert (x * 1.0)[0].item() != 0.0


@x86_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_worker_reads_subnormals_as_zero(dtype, two_threads):
    ops = torch.ops.kvserve_cpu
    rows, hidden = 512, 64  # 512 rows: the parallel_for splits them across both threads
    x = torch.full((rows, hidden), SUBNORMAL).to(dtype)
    assert (x.float() != 0).all(), "the test input must hold subnormals"

    out = torch.empty_like(x)
    ops.rms_norm(out, x, torch.ones(hidden, dtype=dtype), 1e-6)
    assert torch.count_nonzero(out) == 0, "some rows kept subnormals: a worker ran without DAZ"

    act = torch.empty(rows, hidden, dtype=dtype)
    ops.silu_and_mul(act, torch.cat([x, torch.ones_like(x)], dim=1))
    assert torch.count_nonzero(act) == 0

    # paged attention: V all subnormal -> every output row exactly 0, on every worker's items
    seqs, ctx, heads, kv_heads, head_dim, block = 16, 40, 8, 2, 64, 16
    blocks_per_seq = -(-ctx // block)
    k_cache = torch.randn(seqs * blocks_per_seq + 1, block, kv_heads, head_dim).to(dtype)
    v_cache = torch.full_like(k_cache, SUBNORMAL)
    q = torch.randn(seqs, heads, head_dim).to(dtype)
    attn = torch.full_like(q, 7.0)
    tables = torch.arange(1, seqs * blocks_per_seq + 1, dtype=torch.int32).view(seqs, -1)
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    cu = torch.arange(seqs + 1, dtype=torch.int32)
    ops.paged_attention(attn, q, k_cache, v_cache, tables, lens, cu, head_dim**-0.5, 64)
    assert torch.count_nonzero(attn) == 0
    _assert_mode_restored()


def _oracle(q, k_cache, v_cache, tables, lens, scale):
    out = torch.empty_like(q, dtype=torch.float32)
    block = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    for s in range(q.shape[0]):
        n = int(lens[s])
        idx = tables[s, : -(-n // block)].long()
        k = k_cache[idx].reshape(-1, *k_cache.shape[2:])[:n].float().repeat_interleave(group, dim=1)
        v = v_cache[idx].reshape(-1, *v_cache.shape[2:])[:n].float().repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,khd->hk", q[s].float(), k) * scale, dim=-1)
        out[s] = torch.einsum("hk,khd->hd", p, v)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peaky_attention_matches_oracle(dtype):
    gen = torch.Generator().manual_seed(7)
    seqs, ctx, heads, kv_heads, head_dim, block = 4, 300, 8, 2, 64, 16
    nb = seqs * -(-ctx // block)
    k_cache = torch.randn(nb + 1, block, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(nb + 1, block, kv_heads, head_dim, generator=gen).to(dtype)
    q = (30 * torch.randn(seqs, heads, head_dim, generator=gen)).to(dtype)  # scores of std ~30: peaky
    tables = torch.arange(1, nb + 1, dtype=torch.int32).view(seqs, -1)
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    torch.ops.kvserve_cpu.paged_attention(
        out, q, k_cache, v_cache, tables, lens, torch.arange(seqs + 1, dtype=torch.int32), scale, 64
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), _oracle(q, k_cache, v_cache, tables, lens, scale), rtol=tol, atol=tol)


# -- a whole decode step: flat vs peaky attention -----------------------------------------------------------
SEQS, PROMPT, QK_SCALE = 16, 1000, 25.0  # q and k x25: scores x625, spread beyond 87 (the fixture checks)


@pytest.fixture(scope="module")
def flat_and_peaky_dirs(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from kvserve.runtime.models.synthetic import make_random_model_dir

    flat = str(tmp_path_factory.mktemp("flat"))
    make_random_model_dir(
        flat,
        "LlamaForCausalLM",
        seed=0,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=512,
        max_position_embeddings=PROMPT + 64,
        initializer_range=0.02,
    )
    peaky = str(tmp_path_factory.mktemp("peaky"))
    shutil.copytree(flat, peaky, dirs_exist_ok=True)
    tensors = load_file(f"{flat}/model.safetensors")
    for name in tensors:
        if "q_proj" in name or "k_proj" in name:
            tensors[name] = tensors[name] * QK_SCALE
    save_file(tensors, f"{peaky}/model.safetensors", metadata={"format": "pt"})
    assert _underflowing_fraction(tensors) > 0.2, "the peaky model is not peaky enough to test anything"
    return flat, peaky


def _underflowing_fraction(tensors) -> float:
    """Layer 0's share of (query, key) pairs whose softmax weight exp(score - row max) is below FLT_MIN, for
    random tokens (rotary left out: it turns q and k but keeps their norms)."""
    x = tensors["model.embed_tokens.weight"][torch.randint(0, 512, (256,), generator=torch.Generator().manual_seed(0))]
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    q = (x @ tensors["model.layers.0.self_attn.q_proj.weight"].T).view(256, 4, 64)[:, 0]
    k = (x @ tensors["model.layers.0.self_attn.k_proj.weight"].T).view(256, 2, 64)[:, 0]
    scores = q @ k.T / 8.0
    return ((scores.max(-1, keepdim=True).values - scores) > 87.34).float().mean().item()


def _decoding_engine(model_dir, dtype):
    from kvserve.runtime.engine.llm_engine import LLMEngine
    from kvserve.runtime.sampling_params import SamplingParams

    engine = LLMEngine.from_kwargs(
        model_dir,
        dtype=dtype,
        attention_backend="cpu",
        max_num_seqs=SEQS,
        max_model_len=PROMPT + 64,
        block_size=16,
        num_kv_blocks=SEQS * -(-(PROMPT + 64) // 16) + 1,
        max_num_batched_tokens=4096,
    )
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for i in range(SEQS):
        engine.add_request(f"r{i}", {"prompt_token_ids": [rng.randrange(3, 512) for _ in range(PROMPT)]}, params)
    for _ in range(8):  # 16 x 1000 prompt tokens at 4096 per step: prefilled after 4 steps, then decodes
        engine.step()
    return engine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_peaky_decode_step_within_1_2x_of_flat(flat_and_peaky_dirs, dtype):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        flat, peaky = (_decoding_engine(d, dtype) for d in flat_and_peaky_dirs)
        flat_s, peaky_s = [], []
        for _ in range(14):  # interleaved: both see the same background load
            for engine, sink in ((flat, flat_s), (peaky, peaky_s)):
                t = time.perf_counter()
                engine.step()
                sink.append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)
    ratio = min(peaky_s) / min(flat_s)
    # Before the fix this ratio was 1.70 (bf16) and 1.55 (fp32) on the Sapphire Rapids CI machine.
    assert ratio <= 1.2, f"peaky decode step {min(peaky_s) * 1e3:.2f} ms vs flat {min(flat_s) * 1e3:.2f} ms"

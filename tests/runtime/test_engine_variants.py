"""The same greedy tokens under every scheduling/caching variant: prefix caching on/off, block sizes,
tiny chunk budgets, and a KV pool small enough to force preemption."""

from __future__ import annotations

import random

import pytest
from kvserve_testing import check_logprobs_close, hf_greedy

from kvserve.runtime import LLM, SamplingParams

MAX_NEW = 20


@pytest.fixture(scope="module")
def workload(model_factory):
    model_dir, hf_model = model_factory("llama_gqa")
    rng = random.Random(7)
    system = [rng.randrange(3, 512) for _ in range(40)]  # shared prefix: exercises prefix-cache hits
    prompts = [system + [rng.randrange(3, 512) for _ in range(rng.randint(1, 60))] for _ in range(10)]
    prompts += [[rng.randrange(3, 512) for _ in range(rng.randint(1, 100))] for _ in range(10)]
    return model_dir, prompts, hf_greedy(hf_model, prompts, MAX_NEW)


def run(model_dir, prompts, **kwargs):
    llm = LLM(model_dir, max_model_len=256, **kwargs)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
        use_tqdm=False,
    )
    return [o.outputs[0].token_ids for o in outs], llm.engine


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(enable_prefix_caching=True, block_size=16),
        dict(enable_prefix_caching=False, block_size=16),
        dict(block_size=8),
        dict(block_size=32),
        dict(max_num_batched_tokens=32, block_size=16),
        dict(max_num_batched_tokens=32, block_size=8, long_prefill_token_threshold=16),
        dict(enable_chunked_prefill=False, max_num_batched_tokens=256),
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_variants_match_hf(workload, kwargs):
    model_dir, prompts, expected = workload
    got, engine = run(model_dir, prompts, num_kv_blocks=256, **kwargs)
    assert got == expected
    stats = engine.get_stats()
    assert stats.kv_cache_usage == 0.0 and stats.num_requests_running == stats.num_requests_waiting == 0
    if kwargs.get("enable_prefix_caching", True):
        assert stats.prefix_cache_hits >= 9 * 32  # the 10 prompts after the first share >= 2 blocks of 16


def test_prefix_hits_in_second_batch(workload):
    model_dir, prompts, expected = workload
    llm = LLM(model_dir, max_model_len=256, num_kv_blocks=256, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hits_before = llm.engine.get_stats().prefix_cache_hits
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    # The whole workload again: every full prompt block (except each prompt's last token) hits.
    expected_hits = sum(((len(p) - 1) // 16) * 16 for p in prompts)
    assert llm.engine.get_stats().prefix_cache_hits - hits_before == expected_hits


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_keeps_greedy_output(workload, prefix_caching):
    model_dir, prompts, expected = workload
    # 17 usable blocks of 16 tokens: one 256-token sequence fits, twenty concurrent ones do not.
    got, engine = run(
        model_dir,
        prompts,
        num_kv_blocks=18,
        block_size=16,
        enable_prefix_caching=prefix_caching,
        max_num_batched_tokens=64,
    )
    assert engine.scheduler.num_preemptions > 0
    assert got == expected
    assert engine.kv_cache_manager.num_free_blocks == 17


def test_swap_preemption_matches_recompute_and_unconstrained(workload):
    model_dir, prompts, expected = workload
    recompute, _ = run(
        model_dir, prompts, num_kv_blocks=18, block_size=16, max_num_batched_tokens=64, preemption_mode="recompute"
    )
    swap, engine = run(
        model_dir,
        prompts,
        num_kv_blocks=18,
        block_size=16,
        max_num_batched_tokens=64,
        preemption_mode="swap",
        swap_space_bytes=64 * 16 * 256,
    )
    stats = engine.get_stats()
    assert stats.num_swap_outs > 0 and stats.num_swap_ins == stats.num_swap_outs
    assert stats.num_swapped_in_blocks == stats.num_swapped_out_blocks > 0
    assert swap == recompute == expected
    assert stats.num_free_blocks == 17 and stats.num_free_host_blocks == stats.num_total_host_blocks == 64
    assert not engine.scheduler.swapped


def test_swap_space_too_small_falls_back_to_recompute(workload):
    model_dir, prompts, expected = workload
    got, engine = run(
        model_dir,
        prompts,
        num_kv_blocks=18,
        block_size=16,
        max_num_batched_tokens=64,
        preemption_mode="swap",
        swap_space_bytes=1 * 16 * 256,
    )  # one host block
    stats = engine.get_stats()
    assert stats.num_preemptions > 0 and stats.num_swap_outs == 0
    assert got == expected


@pytest.mark.parametrize("kv_cache_dtype,top_n,min_same_first", [("fp8_e4m3", 5, 4), ("fp8_e5m2", 20, 1)])
def test_fp8_kv_cache_on_torch_backend(workload, kv_cache_dtype, top_n, min_same_first):
    """fp8 rounds K/V, so near-ties may flip: vLLM's check_logprobs_close rule -- at the first differing
    token each side's choice must be in the other's top-N, and the comparison stops there. (e5m2 keeps 2
    mantissa bits, so it gets a wider N.) These random models are chaotic: one flip changes the rest."""
    import torch

    model_dir, prompts, _ = workload
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=top_n)
    prompts = [{"prompt_token_ids": p} for p in prompts[:8]]
    budget = 256 * 16 * 256  # 256 blocks of the fp32 cache
    ref = LLM(model_dir, max_model_len=256, kv_cache_bytes=budget).generate(prompts, params, use_tqdm=False)
    llm = LLM(model_dir, max_model_len=256, kv_cache_bytes=budget, kv_cache_dtype=kv_cache_dtype)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert (
        llm.engine.executor.runner.kv.dtype
        == {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
    )
    assert llm.engine.config.cache.num_blocks == 4 * 256  # 1 byte per element instead of 4: 4x the blocks
    assert check_logprobs_close(ref, got) >= min_same_first

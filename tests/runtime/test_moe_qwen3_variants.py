"""Mixtral, Qwen3 and Qwen3-MoE stay token-exact with transformers under prefix caching with chunked prefill
and under preemption (test_fidelity_hf.py covers the plain run of the same models)."""

from __future__ import annotations

import random

import pytest
from kvserve_testing import hf_greedy

from kvserve.runtime import LLM, SamplingParams

MAX_NEW = 16


@pytest.fixture(scope="module", params=["mixtral_moe", "qwen3_moe", "qwen3_head_dim"])
def workload(model_factory, request):
    model_dir, hf_model = model_factory(request.param)
    rng = random.Random(11)
    system = [rng.randrange(3, 512) for _ in range(40)]  # a shared prefix: whole blocks hit the cache
    prompts = [system + [rng.randrange(3, 512) for _ in range(rng.randint(1, 50))] for _ in range(8)]
    prompts += [[rng.randrange(3, 512) for _ in range(rng.randint(1, 90))] for _ in range(6)]
    return request.param, model_dir, prompts, hf_greedy(hf_model, prompts, MAX_NEW)


def _generate(model_dir, prompts, **kwargs):
    llm = LLM(model_dir, max_model_len=256, seed=0, **kwargs)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
        use_tqdm=False,
    )
    return [o.outputs[0].token_ids for o in outs], llm.engine


def test_prefix_caching_and_chunked_prefill(workload):
    name, model_dir, prompts, expected = workload
    # 24-token budget with 8-token blocks: prompts are split into chunks that start mid-block, and the
    # expert routing of a chunk's tokens must not depend on which other tokens share its step.
    got, engine = _generate(
        model_dir, prompts, num_kv_blocks=256, block_size=8, max_num_batched_tokens=24, enable_prefix_caching=True
    )
    assert got == expected, name
    assert engine.get_stats().prefix_cache_hits >= 7 * 40  # the 7 prompts after the first reuse 5 blocks


def test_preemption(workload):
    name, model_dir, prompts, expected = workload
    # 17 usable blocks of 16 tokens for 14 sequences of up to 106 tokens: requests are preempted and
    # recomputed, some of them re-prefilled through prefix-cache hits.
    got, engine = _generate(model_dir, prompts, num_kv_blocks=18, block_size=16, max_num_batched_tokens=64)
    assert engine.scheduler.num_preemptions > 0, name
    assert got == expected, name
    assert engine.kv_cache_manager.num_free_blocks == 17

"""Gemma 2 / Gemma 3 stay token-exact with transformers under prefix caching with chunked prefill and under
preemption, while the engine frees the sliding layers' out-of-window blocks (test_fidelity_hf.py covers the
plain run). Prompts run past the windows (12 and 20 tokens) and the shared prefix is longer than both, so
prefix hits go through the sliding groups' window rule."""

from __future__ import annotations

import random

import pytest
from kvserve_testing import hf_greedy

from kvserve.runtime import LLM, SamplingParams

MAX_NEW = 16


@pytest.fixture(scope="module", params=["gemma2_sliding", "gemma3_sliding"])
def workload(model_factory, request):
    model_dir, hf_model = model_factory(request.param)
    rng = random.Random(13)
    system = [rng.randrange(3, 512) for _ in range(40)]  # 5 blocks of 8: a hit longer than either window
    prompts = [system + [rng.randrange(3, 512) for _ in range(rng.randint(1, 40))] for _ in range(8)]
    prompts += [[rng.randrange(3, 512) for _ in range(rng.randint(1, 80))] for _ in range(6)]
    return request.param, model_dir, prompts, hf_greedy(hf_model, prompts, MAX_NEW)


def _generate(model_dir, prompts, **kwargs):
    llm = LLM(model_dir, max_model_len=256, seed=0, **kwargs)
    kv = llm.engine.kv_cache_manager
    peak = {"sliding": 0}
    allocate = kv.allocate_slots

    def recording_allocate(request, num_new_tokens, new_computed_blocks=()):
        result = allocate(request, num_new_tokens, new_computed_blocks)
        for table in kv.get_group_block_ids(request.request_id):
            peak["sliding"] = max(peak["sliding"], sum(1 for b in table if b))
        return result

    kv.allocate_slots = recording_allocate
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
        use_tqdm=False,
    )
    return [o.outputs[0].token_ids for o in outs], llm.engine, peak["sliding"]


def _window_blocks(engine, block_size: int, max_num_batched_tokens: int) -> int:
    """The most blocks one sliding group may hold: window - 1 + one step, + 1 unaligned block."""
    window = max(engine.kv_cache_manager.group_windows)
    return -(-(window - 1 + max_num_batched_tokens) // block_size) + 1


def test_prefix_caching_and_chunked_prefill(workload):
    name, model_dir, prompts, expected = workload
    got, engine, peak = _generate(
        model_dir, prompts, num_kv_blocks=400, block_size=8, max_num_batched_tokens=24, enable_prefix_caching=True
    )
    assert got == expected, name
    assert engine.kv_cache_manager.num_groups > 1
    assert engine.get_stats().prefix_cache_hits >= 7 * 40  # the 7 prompts after the first reuse 5 blocks
    # Sequences of up to 96 tokens (12 blocks): each sliding group kept only about its window.
    assert 0 < peak <= _window_blocks(engine, 8, 24) < 12


def test_preemption(workload):
    name, model_dir, prompts, expected = workload
    # Room for a few sequences at a time: requests are preempted and recomputed, partly from prefix hits
    # whose sliding-group blocks were freed (and kept their hashes) before the preemption.
    got, engine, peak = _generate(model_dir, prompts, num_kv_blocks=80, block_size=8, max_num_batched_tokens=32)
    assert engine.scheduler.num_preemptions > 0, name
    assert got == expected, name
    assert peak <= _window_blocks(engine, 8, 32)
    assert engine.kv_cache_manager.num_free_blocks == 79

"""Speculative decoding with tensor_parallel_size=2 (gloo/CPU): rank 0 verifies the drafts on the gathered
logits; greedy output equals plain TP=1 decoding token for token, and drafts are accepted."""

from __future__ import annotations

import pytest
from kvserve_testing import STORIES_DIR

from kvserve.runtime import LLM, SamplingParams

STORIES = str(STORIES_DIR)


@pytest.mark.timeout(180)
def test_tp2_ngram_and_suffix_are_token_identical_to_plain_decoding():
    prompts = [
        "Once upon a time, there was a little girl named Lily. She loved to play with her ball. One day, Lily",
        "Tom had a red ball. Tom had a red ball. Tom had a",
    ]
    params = SamplingParams(temperature=0, max_tokens=48)
    common = dict(max_model_len=256, max_num_batched_tokens=32, seed=0)
    plain = [o.outputs[0].token_ids for o in LLM(STORIES, **common).generate(prompts, params, use_tqdm=False)]
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    for spec in (ngram, {"method": "suffix", "num_speculative_tokens": 6}):
        llm = LLM(STORIES, tensor_parallel_size=2, speculative_config=spec, **common)
        try:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            stats = llm.engine.get_stats()
        finally:
            llm.engine.shutdown()
        assert got == plain, spec["method"]
        assert stats.spec_num_accepted_tokens > 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["qwen2_qkv_bias", "mixtral_moe"])
def test_tp2_every_method_is_token_identical_on_parity_families(tp_model_factory, family):
    """TP=2 on random fp32 parity models (qkv bias split across ranks; MoE experts sharded): ngram, suffix and
    draft_model (the target as its own, unsharded draft) give plain TP=1 greedy output token for token."""
    model_dir, _ = tp_model_factory(family)
    shared = [5, 9, 14, 3, 7, 22, 5, 9, 14, 3, 7, 22, 5, 9]  # repeats itself: the proposers find matches
    prompts = [{"prompt_token_ids": shared + [i, 30 + i] * 3} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    common = dict(max_model_len=128, block_size=8, max_num_batched_tokens=32, seed=0)
    with LLM(model_dir, **common) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    methods = [
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        {"method": "suffix", "num_speculative_tokens": 4},
        {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 3},
    ]
    for spec in methods:
        llm = LLM(model_dir, tensor_parallel_size=2, speculative_config=spec, **common)
        try:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            stats = llm.engine.get_stats()
        finally:
            llm.engine.shutdown()
        assert got == plain, (family, spec["method"])
        assert stats.spec_num_accepted_tokens > 0, (family, spec["method"])

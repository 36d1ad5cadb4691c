"""A draft model with a tensor-parallel target (TP=2, gloo/CPU): the draft runs unsharded in the engine core
process (vLLM's draft_tensor_parallel_size=1), rank 0 verifies; greedy output equals plain TP=1 decoding and,
with the target as its own draft, every draft is accepted."""

from __future__ import annotations

import pytest

from kvserve.runtime import LLM, SamplingParams


@pytest.mark.timeout(180)
def test_tp2_target_with_an_unsharded_draft_is_token_identical(stories_dir):
    prompts = [
        "Once upon a time, there was a little girl named Lily. She loved to play with her ball. One day, Lily",
        "Tom had a red ball. Tom had a red ball. Tom had a",
    ]
    params = SamplingParams(temperature=0, max_tokens=40)
    common = dict(max_model_len=256, max_num_batched_tokens=32, seed=0)
    plain = [o.outputs[0].token_ids for o in LLM(stories_dir, **common).generate(prompts, params, use_tqdm=False)]
    spec = {"method": "draft_model", "model": stories_dir, "num_speculative_tokens": 3}
    llm = LLM(stories_dir, tensor_parallel_size=2, speculative_config=spec, **common)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.get_stats()
        draft_runner = llm.engine.core.proposer.runner
    finally:
        llm.engine.shutdown()
    assert got == plain
    assert draft_runner.parallel.size == 1 and draft_runner.num_kv_heads == 4  # all 4 KV heads: unsharded
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens

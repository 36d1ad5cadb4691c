"""Speculative decoding on the other parity model families (issue 27 done-when: "token-identical on the parity
models"): test_spec_decode_engine.py and test_spec_decode_draft.py cover llama_gqa in depth (chunking,
caching, preemption); here each method -- ngram, suffix and draft_model (the target as its own draft) -- gives
greedy fp32 output identical to plain decoding on Qwen2 (qkv bias), tied-embedding MQA Llama, Mixtral (MoE),
Qwen3 (head_dim != hidden/heads) and Qwen3-MoE, and drafts are proposed and accepted on each."""

from __future__ import annotations

import pytest

from kvserve.runtime.engine.llm import LLM
from kvserve.runtime.sampling_params import SamplingParams

FAMILIES = ["qwen2_qkv_bias", "llama_tied_mqa", "mixtral_moe", "qwen3_head_dim", "qwen3_moe"]
KW = dict(max_model_len=128, block_size=8, max_num_batched_tokens=32, max_num_seqs=4, seed=0)


def _run(model_dir, spec):
    shared = [5, 9, 14, 3, 7, 22, 5, 9, 14, 3, 7, 22, 5, 9]  # repeats itself: the proposers find matches
    prompts = [shared + [i, 30 + i] * 3 for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(model_dir, **KW, speculative_config=spec)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.engine.get_stats()
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_method_is_token_identical_on_the_family(model_factory, family):
    model_dir, _ = model_factory(family)
    plain, _ = _run(model_dir, None)
    methods = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "suffix": {"method": "suffix", "num_speculative_tokens": 4},
        "draft_model": {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 3},
    }
    for method, spec in methods.items():
        got, stats = _run(model_dir, spec)
        assert got == plain, (family, method)
        assert stats.spec_num_drafts > 0, (family, method)
        if method == "draft_model":  # the target drafting for itself: every draft token is accepted
            assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0, (family, stats)

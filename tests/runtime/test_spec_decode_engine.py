"""Speculative decoding in the engine: greedy output token-identical to plain decoding (fp32) with each
method, under chunked prefill, prefix caching and preemption, beside requests that never draft; the
acceptance counters move; temperature sampling with drafts still completes."""

from __future__ import annotations

import re

import pytest

from kvserve.runtime.engine.llm import LLM
from kvserve.runtime.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 6}


def run(model_dir, prompts, params, spec, **kw):
    llm = LLM(model_dir, **{"max_model_len": 256, "seed": 0, **kw}, speculative_config=spec)
    outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], llm.engine.get_stats()


@pytest.mark.parametrize("spec", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_greedy_is_token_identical_under_chunking_caching_and_preemption(model_factory, spec):
    model_dir, _ = model_factory("llama_gqa")
    shared = [5, 9, 14, 3, 7, 22, 5, 9, 14, 3, 7, 22, 5, 9]  # repeats itself: the proposers find matches
    prompts = [shared + [i, 30 + i] * 3 for i in range(6)] + [[40, 41, 42, 40, 41] * 9]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) for _ in prompts]
    params[2] = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.2)  # sequential
    # 16-token budget: prompts are chunked and drafts trimmed; 24 blocks of 8: the 7 requests preempt.
    kw = dict(block_size=8, num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=8, max_model_len=128)
    plain, _ = run(model_dir, prompts, params, None, **kw)
    got, stats = run(model_dir, prompts, params, {**spec, "disable_by_batch_size": 8}, **kw)
    assert got == plain
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_num_drafts > 0 and stats.spec_num_draft_tokens >= stats.spec_num_drafts


def test_a_pretrained_model_accepts_drafts_and_stays_identical(stories_dir):
    prompts = [
        "Once upon a time, there was a little girl named Lily. She loved to play with her ball. One day, Lily",
        "Tom had a red ball. Tom had a red ball. Tom had a",
    ]
    params = SamplingParams(temperature=0, max_tokens=80)
    plain, _ = run(stories_dir, prompts, params, None)
    for spec in (NGRAM, SUFFIX):
        got, stats = run(stories_dir, prompts, params, spec)
        assert got == plain, spec["method"]
        # Real text repeats itself: a good share of drafts is accepted, at more than the first position.
        assert stats.spec_num_accepted_tokens > 0.2 * stats.spec_num_draft_tokens, stats
        assert len(stats.spec_accepted_per_pos) > 1 and stats.spec_accepted_per_pos[1] > 0


def test_sampling_with_drafts_completes_and_the_load_switch_turns_drafting_off(stories_dir):
    prompts = ["Tom had a red ball. Tom had a red ball. Tom had a"] * 4
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=30, seed=3, ignore_eos=True)
    outs, stats = run(stories_dir, prompts, params, NGRAM)
    assert all(len(o) == 30 for o in outs) and stats.spec_num_drafts > 0
    _, off = run(stories_dir, prompts, params, {**NGRAM, "disable_by_batch_size": 3})  # 4 running > 3
    assert off.spec_num_drafts == 0


def test_penalties_logprobs_min_tokens_and_grammars_draft_and_stay_identical(stories_dir):
    """Requests whose processing depends on the tokens before it in the step are verified position by position
    through the sampler: tokens, logprobs and the grammar's output equal plain decoding's."""
    from kvserve.runtime.structured_output.spec import StructuredOutputSpec

    prompt = "Tom had a red ball. Tom had a red ball. Tom had a"
    regex = StructuredOutputSpec.from_request(
        "regex", r" (red|big) ball\. Tom had a (red|big) ball\.( Tom had a [a-z]+ ball\.)*", "regex"
    )
    variants = [
        SamplingParams(temperature=0, max_tokens=50, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=50, logprobs=3),
        SamplingParams(temperature=0, max_tokens=50, min_tokens=45),
        SamplingParams(temperature=0, max_tokens=60, structured_outputs=regex),
    ]
    results = {}
    for spec in (None, NGRAM):
        llm = LLM(stories_dir, max_model_len=256, seed=0, speculative_config=spec)
        outs = llm.generate([prompt] * len(variants), variants, use_tqdm=False)
        results[spec is None] = (outs, llm.engine.get_stats())
    (plain, _), (got, stats) = results[True], results[False]
    for p_out, g_out in zip(plain, got):
        assert g_out.outputs[0].token_ids == p_out.outputs[0].token_ids
        assert g_out.outputs[0].text == p_out.outputs[0].text
    lp_plain, lp_got = plain[1].outputs[0].logprobs, got[1].outputs[0].logprobs
    assert len(lp_got) == len(lp_plain)
    for a, b in zip(lp_plain, lp_got):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert re.match(r"\s*(red|big) ball\. Tom had a (red|big) ball\.", got[3].outputs[0].text)  # the grammar held
    assert stats.spec_num_accepted_tokens > 0

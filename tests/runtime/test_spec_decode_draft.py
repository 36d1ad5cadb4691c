"""Draft-model speculative decoding in the engine (fp32): greedy output token-identical to plain decoding with
the target itself as draft (every draft accepted: the counters prove it) and with a different, smaller random
model of the same vocabulary (few accepted), under chunked prefill and preemption; a full draft KV pool only
costs drafts; the draft's blocks all come back; sampled requests draft from q and stay seed-reproducible;
config errors name speculative_config."""

from __future__ import annotations

import json
import os

import pytest

from kvserve.runtime.engine.llm import LLM
from kvserve.runtime.errors import InvalidParameter
from kvserve.runtime.sampling_params import SamplingParams
from kvserve.runtime.speculative_config import parse_speculative_config

# 16-token budget: prompts are chunked (in the target and in the draft) and drafts trimmed; 20 blocks of 8:
# the 7 requests preempt each other.
TIGHT = dict(block_size=8, num_kv_blocks=20, max_num_batched_tokens=16, max_num_seqs=8, max_model_len=128)


def draft_spec(model_dir, k=4, **extra):
    return {"method": "draft_model", "model": model_dir, "num_speculative_tokens": k, **extra}


def run(model_dir, prompts, params, spec, **kw):
    llm = LLM(model_dir, **{"max_model_len": 256, "seed": 0, **kw}, speculative_config=spec)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.engine.get_stats(), llm.engine.core.proposer


@pytest.fixture(scope="module")
def small_draft_dir(tmp_path_factory):
    """A 1-layer, narrower random model with llama_gqa's vocabulary (512): a poor but valid draft."""
    from kvserve.runtime.models.synthetic import make_random_model_dir

    out = str(tmp_path_factory.mktemp("small-draft"))
    make_random_model_dir(
        out,
        "LlamaForCausalLM",
        seed=7,
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
    )
    return out


def prompts_and_params(penalty: bool = True):
    shared = [5, 9, 14, 3, 7, 22, 5, 9, 14, 3, 7, 22, 5, 9]
    prompts = [shared + [i, 30 + i] * 3 for i in range(6)] + [[40, 41, 42, 40, 41] * 9]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) for _ in prompts]
    if penalty:  # verified position by position (spec_decode/verify.py); the draft ignores the penalty
        params[2] = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.2)
    return prompts, params


@pytest.mark.parametrize("draft", ["itself", "smaller"])
def test_greedy_is_token_identical_under_chunking_and_preemption(model_factory, small_draft_dir, draft):
    model_dir, _ = model_factory("llama_gqa")
    draft_dir = model_dir if draft == "itself" else small_draft_dir
    prompts, params = prompts_and_params()
    plain, _, _ = run(model_dir, prompts, params, None, **TIGHT)
    got, stats, proposer = run(model_dir, prompts, params, draft_spec(draft_dir), **TIGHT)
    assert got == plain
    assert stats.num_preemptions > 0 and stats.spec_num_drafts > 0
    if draft == "itself":  # the same weights propose the target's argmax: only the penalised request rejects
        assert stats.spec_num_accepted_tokens > 0.9 * stats.spec_num_draft_tokens, stats
        assert stats.spec_num_draft_tokens > 3 * stats.spec_num_drafts  # mostly all 4 drafts (the tail trims)
    else:
        assert stats.spec_num_accepted_tokens < 0.5 * stats.spec_num_draft_tokens, stats
    # The next step's proposal frees the draft blocks of requests no longer running: all of them now.
    proposer.propose([])
    assert proposer.num_free_blocks == proposer.runner.num_blocks - 1
    assert proposer.num_forwards > 0


def test_a_full_draft_pool_only_costs_drafts(model_factory):
    """Room in the draft's KV for about one sequence: most requests get no drafts most steps, none fails."""
    model_dir, _ = model_factory("llama_gqa")
    prompts, params = prompts_and_params(penalty=False)
    kw = dict(TIGHT, num_kv_blocks=64)  # no target preemption: the draft pool is the bottleneck
    plain, _, _ = run(model_dir, prompts, params, None, **kw)
    # llama_gqa: 2 layers x 2 KV heads x head_dim 8 x K and V x fp32 = 256 bytes per token, 2 KiB per block
    spec = draft_spec(model_dir, draft_kv_cache_bytes=18 * 2048)
    got, stats, proposer = run(model_dir, prompts, params, spec, **kw)
    assert proposer.runner.num_blocks == 18
    assert got == plain
    assert 0 < stats.spec_num_drafts
    # 7 requests x 40 decode steps would be ~280 request-steps with drafts; the pool admits far fewer.
    assert stats.spec_num_drafts < 100, stats
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    proposer.propose([])
    assert proposer.num_free_blocks == 17


def test_stories260k_with_itself_as_draft(stories_dir):
    prompts = [
        "Once upon a time, there was a little girl named Lily. She loved to play with her ball. One day, Lily",
        "Tom had a red ball. Tom had a red ball. Tom had a",
    ]
    params = SamplingParams(temperature=0, max_tokens=60)
    plain, _, _ = run(stories_dir, prompts, params, None)
    got, stats, _ = run(stories_dir, prompts, params, draft_spec(stories_dir, k=3))
    assert got == plain
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    assert stats.spec_accepted_per_pos[2] > 0


def test_sampled_requests_draft_from_q_and_are_seed_reproducible(stories_dir):
    prompts = ["Tom had a red ball. Tom had a red ball. Tom had a"] * 3
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=30, seed=3, ignore_eos=True)
    spec = draft_spec(stories_dir, k=3)
    first, stats, _ = run(stories_dir, prompts, params, spec)
    again, _, _ = run(stories_dir, prompts, params, spec)
    assert first == again and all(len(o) == 30 for o in first)
    # Same weights, same temperature/top-k: q == p, so min(1, p/q) accepts (nearly) every draft; the
    # one-hot rule would accept only p(d) of them.
    assert stats.spec_num_drafts > 0
    assert stats.spec_num_accepted_tokens > 0.95 * stats.spec_num_draft_tokens, stats


def test_config_errors_name_speculative_config(model_factory, tmp_path):
    model_dir, _ = model_factory("llama_gqa")
    cases = [
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        ({"method": "draft_model", "model": model_dir}, "num_speculative_tokens"),
        (draft_spec(str(tmp_path)), "no config.json"),
        (draft_spec(model_dir, draft_tensor_parallel_size=2), "draft_tensor_parallel_size"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": model_dir}, "only used by method draft_model"),
    ]
    for spec, words in cases:
        with pytest.raises(InvalidParameter, match=words) as info:
            parse_speculative_config(spec)
        assert info.value.param == "speculative_config"
    # vLLM: a model without a method is a draft model
    assert parse_speculative_config({"model": model_dir, "num_speculative_tokens": 2}).method == "draft_model"

    other = tmp_path / "other-vocab"
    other.mkdir()
    config = json.load(open(os.path.join(model_dir, "config.json")))
    json.dump({**config, "vocab_size": 1000}, open(other / "config.json", "w"))
    with pytest.raises(InvalidParameter, match=r"speculative_config\.model .*vocab_size 1000.* 512") as info:
        LLM(model_dir, max_model_len=128, speculative_config=draft_spec(str(other)))
    assert info.value.param == "speculative_config"


def test_the_draft_cache_rolls_back_to_the_tokens_the_target_kept(model_factory):
    """After drafts the target rejected -- also when the request then decoded steps without drafting (the
    load switch) -- the draft proposes exactly what a fresh draft cache proposes for the same tokens."""
    from kvserve.runtime.config import make_engine_config
    from kvserve.runtime.executor.draft_model import DraftModelProposer
    from kvserve.runtime.request import Request

    model_dir, _ = model_factory("llama_gqa")
    spec = draft_spec(model_dir, k=4, disable_by_batch_size=1)
    config = make_engine_config(model_dir, max_model_len=128, block_size=8, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=60)

    def decoding(tokens):
        r = Request("r", tokens[:20], params)
        r.all_token_ids = list(tokens)
        r.num_computed_tokens = len(tokens) - 1
        return r

    def fresh_drafts(tokens):
        r = decoding(tokens)
        DraftModelProposer(config, 40).propose([r])
        return r.spec_token_ids

    proposer = DraftModelProposer(config, 40)
    prompt = [(7 * i) % 500 + 3 for i in range(20)]
    r = decoding(prompt)
    proposer.propose([r])
    first = r.spec_token_ids
    assert len(first) == 4 and first == fresh_drafts(prompt)
    # The target kept the first draft and then chose another token than the second one.
    r.all_token_ids += [first[0], (first[1] + 1) % 512]
    r.num_computed_tokens = r.num_tokens - 1
    proposer.propose([r])
    assert r.spec_token_ids == fresh_drafts(r.all_token_ids)
    # All rejected; then two requests run (above disable_by_batch_size 1): three steps without drafts.
    other = decoding(prompt[::-1])
    r.all_token_ids += [(r.spec_token_ids[0] + 1) % 512]
    for _ in range(3):
        r.num_computed_tokens = r.num_tokens - 1
        proposer.propose([r, other])
        assert r.spec_token_ids == [] and not proposer.enabled
        r.all_token_ids += [(r.all_token_ids[-1] * 3) % 500 + 3]
    r.num_computed_tokens = r.num_tokens - 1
    proposer.propose([r])
    assert r.spec_token_ids == fresh_drafts(r.all_token_ids)

"""Speculative decoding, pure parts: --speculative-config parsing, n-gram and suffix proposals, the scheduler
with drafts at block level (rollback, no caching of drafts, stops inside accepted tokens), the load switch."""

from __future__ import annotations

import pytest

from kvserve.runtime.core.kv_cache_manager import KVCacheManager
from kvserve.runtime.core.outputs import ModelRunnerOutput
from kvserve.runtime.core.scheduler import Scheduler, SchedulerConfig
from kvserve.runtime.errors import InvalidParameter
from kvserve.runtime.request import Request, RequestStatus
from kvserve.runtime.sampling_params import SamplingParams
from kvserve.runtime.spec_decode.ngram import NgramIndex
from kvserve.runtime.spec_decode.proposer import Proposer
from kvserve.runtime.spec_decode.suffix import Corpus, SharedOutputs, propose_from
from kvserve.runtime.speculative_config import parse_speculative_config

BS = 4


# -- config ------------------------------------------------------------------------------------------------
def test_config_follows_vllm_defaults():
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max, cfg.num_speculative_tokens) == (5, 5, 3)
    cfg = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (4, 4)  # one given: copied to the other
    cfg = parse_speculative_config({"method": "suffix"})
    assert cfg.num_speculative_tokens == cfg.suffix_decoding_max_tree_depth == 24
    assert parse_speculative_config(None) is None


@pytest.mark.parametrize(
    "value, words",
    [
        ("{not json", "not valid JSON"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "EAGLE is not supported yet"),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "<="),
        ('{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}', "unknown key(s) typo"),
        ('{"method": "suffix", "suffix_decoding_min_token_prob": 2}', "in [0.0, 1.0]"),
        ("[1]", "JSON object"),
    ],
)
def test_config_errors_name_the_field(value, words):
    with pytest.raises(InvalidParameter) as err:
        parse_speculative_config(value)
    assert err.value.param == "speculative_config" and words in str(err.value)


# -- proposals ---------------------------------------------------------------------------------------------
def test_ngram_takes_the_longest_latest_match_and_never_the_suffix_itself():
    index = NgramIndex(1, 3)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [9, 1, 2, 3, 7, 8, 1, 2, 3, 4, 5, 2, 3]
    # suffix (2, 3) occurs at 1-3 (continues 3->7? no: continuation of (2,3) ending at 3 is 7) and 7-8 (-> 4):
    # the longest n with a match is 2 ((1,2,3)? no: the suffix is (5,2,3), never seen), latest occurrence wins.
    assert index.propose(tokens, 3) == [4, 5, 2]
    assert NgramIndex(4, 4).propose(tokens, 3) == []  # no 4-gram match
    assert NgramIndex(1, 1).propose([5], 3) == []  # a lone token matches nothing (not itself)


def test_ngram_continues_a_period_past_the_end_and_updates_incrementally():
    index = NgramIndex(2, 2)
    tokens = [1, 2, 1, 2]
    assert index.propose(tokens, 5) == [1, 2, 1, 2, 1]
    tokens += [6, 1, 2]
    # (1, 2) now last seen at 5-6... its latest *earlier* occurrence ends at 3 and continued with 6.
    assert index.propose(tokens, 2) == [6, 1]


def test_suffix_proposes_the_most_frequent_continuation_and_stops_on_low_probability():
    corpus = Corpus()
    context = [1, 2, 3, 4, 9, 1, 2, 3, 4, 9, 1, 2, 3, 5, 8, 1, 2, 3]
    corpus.extend(context)
    proposal, score = propose_from(corpus, context, len(context), 8, 24, 1.0, 0.1)
    # (1,2,3) was followed by 4 twice and 5 once: 4 (prob 2/3), then 9 (its 2 occurrences agree), then 1, 2, 3.
    assert proposal[:3] == [4, 9, 1] and abs(score - (2 / 3) * 3) < 0.3
    strict, _ = propose_from(corpus, context, len(context), 8, 24, 1.0, 0.9)
    assert strict == []  # 2/3 < 0.9
    short, _ = propose_from(corpus, context, len(context), 8, 24, 0.5, 0.1)
    assert len(short) <= 3 * 0.5 + 1  # max_spec_factor bounds the guess by the match length (matched 3)


def test_shared_outputs_feed_new_requests_and_stay_bounded():
    shared = SharedOutputs(max_requests=4)
    for i in range(10):
        shared.add([100 + i, 7, 8, 9, 10])
    assert len(shared.sequences) <= 4
    proposal, _ = propose_from(shared.corpus, [5, 5, 7, 8], -1, 3, 24, 2.0, 0.1)
    assert proposal == [9, 10]  # stops at the end of each stored output (the separator)


# -- scheduler with drafts ---------------------------------------------------------------------------------
def make(num_blocks=20, budget=32, max_model_len=64):
    kv = KVCacheManager(num_blocks, BS)
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=max_model_len), kv
    ), kv


def req(rid, prompt, max_tokens=16, **kw):
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, **kw), frozenset({2}))


def prefill(s, r):
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput({x.req_id: 50 for x in out.scheduled if x.sample}))


def test_drafts_are_scheduled_verified_and_rolled_back():
    s, kv = make()
    r = req("a", [10, 11, 12, 13, 14, 15])  # 6 prompt tokens; after prefill 7 tokens, 6 computed
    prefill(s, r)
    r.spec_token_ids = [60, 61, 62, 63]
    out = s.schedule()
    (sched,) = out.scheduled
    assert sched.token_ids == [50, 60, 61, 62, 63] and sched.num_spec_tokens == 4 and sched.sample
    assert len(kv.get_block_ids("a")) == 3  # slots for 6 + 5 = 11 tokens
    # The runner accepted 60, 61 and then produced 70 instead of 62.
    outs = s.update_from_output(out, ModelRunnerOutput({}, spec_token_ids={"a": [60, 61, 70]}))
    assert outs[0].new_token_ids == [60, 61, 70]
    assert r.all_token_ids[-4:] == [50, 60, 61, 70] and r.num_tokens == 10
    assert r.num_computed_tokens == 9  # 50, 60, 61 computed; 70 is next step's input
    assert r.spec_token_ids == []
    assert (s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens) == (1, 4, 2)
    assert s.spec_accepted_per_pos == [1, 1, 0, 0]
    out = s.schedule()  # a plain decode of 70 at position 9, in the blocks it already holds
    assert [(x.token_ids, x.start_position, x.num_spec_tokens) for x in out.scheduled] == [([70], 9, 0)]


def test_blocks_holding_drafts_are_never_prefix_cached():
    s, kv = make()
    r = req("a", [10, 11, 12])  # block 0 = 10 11 12 50 after the prefill's token
    prefill(s, r)
    r.spec_token_ids = [60, 61, 62, 63]  # would fill block 1 with 60 61 62 63: all drafts
    out = s.schedule()
    assert kv.num_cached_blocks["a"] == 1  # block 0 only (its 4 real tokens), not the drafts' block
    s.update_from_output(out, ModelRunnerOutput({}, spec_token_ids={"a": [99]}))  # every draft rejected
    other = req("b", [10, 11, 12, 50, 60, 61, 62, 63, 1])
    hit, num_hit = kv.get_computed_blocks(other)
    assert num_hit == BS  # block 0 is shared; the rejected drafts' block is not
    assert r.num_computed_tokens == 4 and r.all_token_ids[-1] == 99


def test_a_stop_token_inside_the_accepted_tokens_ends_the_request_there():
    s, _ = make()
    r = req("a", [10, 11, 12])
    prefill(s, r)
    r.spec_token_ids = [60, 2, 61]
    out = s.schedule()
    outs = s.update_from_output(out, ModelRunnerOutput({}, spec_token_ids={"a": [60, 2, 61, 62]}))
    assert outs[0].new_token_ids == [60, 2] and outs[0].finish_reason == "stop"
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [50, 60, 2]


def test_the_budget_trims_drafts_and_preemption_drops_them():
    s, _ = make(budget=3)
    r = req("a", [10, 11])
    prefill(s, r)
    r.spec_token_ids = [60, 61, 62, 63]
    (sched,) = s.schedule().scheduled
    assert sched.token_ids == [50, 60, 61] and sched.num_spec_tokens == 2
    r.spec_token_ids = [1, 2]
    s._preempt(r)
    assert r.spec_token_ids == []


def test_proposer_respects_limits_and_the_load_switch():
    cfg = parse_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "disable_by_batch_size": 2}
    )
    proposer = Proposer(cfg, max_model_len=64)
    s, _ = make()
    a = req("a", [50, 7, 8, 50, 7], max_tokens=3)  # + the prefill's 50: the 1-gram (50) continues with 7
    b = req("b", [50, 7, 8, 50, 7], repetition_penalty=1.1)  # drafts too (verified position by position)
    s.add_request(a)
    prefill(s, b)  # one step prefills both
    proposer.propose(s.running)
    assert a.spec_token_ids == [7]  # max_tokens 3, 1 produced: room for 1 draft + the token after it
    # b: 50 7 8 50 7 | 50 -> (50) last seen at 3, continued 7 50, then that period again: k = 4 drafts.
    assert b.spec_token_ids == [7, 50, 7, 50]
    c = req("c", [50, 7, 8, 50, 7])
    prefill(s, c)
    proposer.propose(s.running)  # 3 running > disable_by_batch_size 2: nobody drafts
    assert not proposer.enabled and all(r.spec_token_ids == [] for r in s.running)

"""n > 1 fanned out in front (engine/parent_request.py): the core sees n one-sequence requests that share the
prompt's full KV blocks through prefix caching -- the same physical blocks, ref-counted -- and compute only
what prefix caching recomputes. Block level with fake requests first, then the real engine."""

from __future__ import annotations

import pytest

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.core.kv_cache_manager import KVCacheManager
from kvserve.runtime.core.outputs import ModelRunnerOutput
from kvserve.runtime.core.scheduler import Scheduler, SchedulerConfig
from kvserve.runtime.engine.parent_request import ParentRequest, child_request_id
from kvserve.runtime.errors import STEP_FAILED
from kvserve.runtime.request import Request

BS = 4


def fan_out(s: Scheduler, request_id: str, prompt: list[int], params: SamplingParams) -> list[str]:
    """What the front does: the children, queued back to back."""
    children = ParentRequest(request_id, params).children
    for child in children:
        s.add_request(Request(child.request_id, prompt, child.params, frozenset({2})))
    return [child.request_id for child in children]


def make(budget=64, caching=True, num_blocks=40, max_num_seqs=8, threshold=0) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=128,
        long_prefill_token_threshold=threshold,
    )
    return Scheduler(cfg, KVCacheManager(num_blocks, BS, enable_caching=caching))


def run_step(s: Scheduler, computed: dict[str, int]):
    out = s.schedule()
    for x in out.scheduled:
        computed[x.req_id] = computed.get(x.req_id, 0) + len(x.token_ids)
    s.update_from_output(out, ModelRunnerOutput({x.req_id: 7 for x in out.scheduled if x.sample}))
    return out


def test_children_have_their_own_ids_params_and_seeds():
    parent = ParentRequest("r", SamplingParams(n=3, seed=10, temperature=1.0))
    assert parent.child_ids == ["r#0", "r#1", "r#2"] == [child_request_id("r", i) for i in range(3)]
    assert [(c.index, c.params.n, c.params.seed, c.counts_prompt_tokens) for c in parent.children] == [
        (0, 1, 10, True),
        (1, 1, 11, False),
        (2, 1, 12, False),
    ]
    unseeded = ParentRequest("u", SamplingParams(n=2)).children
    assert [c.params.seed for c in unseeded] == [None, None]
    single = SamplingParams(seed=4)
    assert ParentRequest("s", single).children[0].params is single  # n=1: the params as they came
    # one-to-one: a user id that looks like a child id cannot collide with another request's child
    assert child_request_id("x#1", 0) != child_request_id("x", 1)


def test_children_share_the_prompts_full_blocks_in_the_first_step():
    s = make()
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    ids = fan_out(s, "p", prompt, SamplingParams(n=3, max_tokens=3, ignore_eos=True))
    computed: dict[str, int] = {}
    out = run_step(s, computed)
    # child 0 computes the prompt; its siblings, admitted in the same step, hit its 2 full blocks (cached as
    # they were allocated) and compute only the partial last block. All three sample in this step.
    assert [(x.req_id, x.start_position, len(x.token_ids), x.sample) for x in out.scheduled] == [
        ("p#0", 0, 10, True),
        ("p#1", 8, 2, True),
        ("p#2", 8, 2, True),
    ]
    tables = [s.kv.req_to_blocks[rid] for rid in ids]
    assert [[b.block_id for b in t] for t in tables] == [[1, 2, 3], [1, 2, 4], [1, 2, 5]]
    assert all(t[0] is tables[0][0] and t[1] is tables[0][1] for t in tables)  # the same physical blocks
    assert [b.ref_cnt for b in tables[0]] == [3, 3, 1]
    assert s.kv.prefix_cache_hits == 2 * 8 and s.kv.prefix_cache_queries == 3 * 10
    while s.has_unfinished_requests():
        run_step(s, computed)
    # no recompute beyond prefix caching's: 10 + 2 + 2 prompt tokens, then 2 decodes each
    assert computed == {"p#0": 12, "p#1": 4, "p#2": 4}
    assert s.kv.usage == 0.0


def test_a_chunked_prompt_is_computed_once_and_the_siblings_join_when_it_is_done():
    s = make(budget=8)
    prompt = list(range(100, 130))  # 30 tokens: 7 full blocks + 2
    ids = fan_out(s, "p", prompt, SamplingParams(n=3, max_tokens=2, ignore_eos=True))
    computed: dict[str, int] = {}
    steps = [
        [(x.req_id, x.start_position, len(x.token_ids)) for x in run_step(s, computed).scheduled] for _ in range(4)
    ]
    out = s.schedule()  # step 5, looked at before its results finish p#0 and p#1
    steps.append([(x.req_id, x.start_position, len(x.token_ids)) for x in out.scheduled])
    assert steps == [
        [("p#0", 0, 8)],
        [("p#0", 8, 8)],
        [("p#0", 16, 8)],  # child 0's chunks take the whole budget
        [("p#0", 24, 6), ("p#1", 28, 2)],  # child 0 finishes its prompt; p#1 hits all 7 full blocks
        [("p#0", 30, 1), ("p#1", 30, 1), ("p#2", 28, 2)],
    ]
    shared = s.kv.req_to_blocks["p#0"][:7]
    for rid in ids:
        assert all(a is b for a, b in zip(s.kv.req_to_blocks[rid][:7], shared))  # the same physical blocks
    assert [b.ref_cnt for b in shared] == [3] * 7
    for x in out.scheduled:
        computed[x.req_id] = computed.get(x.req_id, 0) + len(x.token_ids)
    s.update_from_output(out, ModelRunnerOutput({x.req_id: 7 for x in out.scheduled if x.sample}))
    assert s.kv.prefix_cache_hits == 2 * 28
    while s.has_unfinished_requests():
        run_step(s, computed)
    assert computed == {"p#0": 31, "p#1": 3, "p#2": 3}  # the prompt once, plus each sibling's tail
    assert s.kv.usage == 0.0


def test_a_block_aligned_prompt_recomputes_only_its_last_block():
    """Prefix caching keeps the last token's block out of a hit (its logits are needed): a sibling of an
    8-token prompt hits block 1 and computes tokens 4..7 into a block of its own."""
    s = make()
    ids = fan_out(s, "p", list(range(100, 108)), SamplingParams(n=2, max_tokens=1))
    out = s.schedule()
    assert [(x.req_id, x.start_position, len(x.token_ids)) for x in out.scheduled] == [("p#0", 0, 8), ("p#1", 4, 4)]
    assert [s.kv.get_block_ids(rid) for rid in ids] == [[1, 2], [1, 3]]
    assert s.kv.req_to_blocks["p#0"][0].ref_cnt == 2


def test_without_prefix_caching_the_children_prefill_separately():
    s = make(caching=False)
    ids = fan_out(s, "p", list(range(100, 110)), SamplingParams(n=3, max_tokens=1))
    out = s.schedule()
    assert [(x.req_id, len(x.token_ids)) for x in out.scheduled] == [("p#0", 10), ("p#1", 10), ("p#2", 10)]
    tables = [s.kv.get_block_ids(rid) for rid in ids]
    assert tables == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert all(b.ref_cnt == 1 for rid in ids for b in s.kv.req_to_blocks[rid])


def test_children_take_one_seat_each_and_a_later_request_queues_behind_them():
    s = make(max_num_seqs=2)
    fan_out(s, "p", list(range(100, 106)), SamplingParams(n=3, max_tokens=2, ignore_eos=True))
    s.add_request(Request("q", [1, 2, 3], SamplingParams(max_tokens=2)))
    computed: dict[str, int] = {}
    assert [x.req_id for x in run_step(s, computed).scheduled] == ["p#0", "p#1"]
    order = []
    while s.has_unfinished_requests():
        order += [x.req_id for x in run_step(s, computed).scheduled if x.req_id not in order]
    assert order[-2:] == ["p#2", "q"]


# -- the engine -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(model_factory):
    model_dir, _ = model_factory("llama_gqa")
    return LLM(
        model_dir, max_model_len=64, num_kv_blocks=64, block_size=16, max_num_seqs=4, max_consecutive_step_failures=2
    )


def _finish(engine) -> dict:
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def test_the_engines_children_share_prompt_blocks_and_count_the_prompt_once(llm):
    engine = llm.engine
    prompt = [60 + i for i in range(37)]  # 2 full 16-token blocks + 5 tokens, never seen by this engine
    before = engine.get_stats()
    engine.add_request(
        "p",
        {"prompt_token_ids": prompt},
        SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=6, ignore_eos=True, logprobs=1),
    )
    first = engine.step()
    tables = [engine.kv_cache_manager.req_to_blocks[f"p#{i}"] for i in range(3)]
    assert all(t[:2] == tables[0][:2] and t[0] is tables[0][0] and t[1] is tables[0][1] for t in tables)
    assert [b.ref_cnt for b in tables[0][:2]] == [3, 3]
    assert len({t[2].block_id for t in tables}) == 3  # each child's partial block is its own
    assert [len(c.token_ids) for c in first[0].outputs] == [1, 1, 1]  # all three sampled in step 1
    final = _finish(engine)["p"]
    stats = engine.get_stats()
    assert stats.prefix_cache_hits - before.prefix_cache_hits == 2 * 32  # the siblings' hits
    assert stats.prompt_tokens - before.prompt_tokens == 37  # once, as the request-level histogram counts it
    assert stats.generation_tokens - before.generation_tokens == 18
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert all(c.finish_reason == "length" and len(c.logprobs) == 6 for c in final.outputs)
    assert final.outputs[0].cumulative_logprob == pytest.approx(
        sum(lp[t].logprob for lp, t in zip(final.outputs[0].logprobs, final.outputs[0].token_ids))
    )
    # choice i is the single request seeded seed + i
    alone = llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True),
        use_tqdm=False,
    )
    assert alone[0].outputs[0].token_ids == final.outputs[2].token_ids
    assert stats.num_free_blocks == stats.num_total_blocks


def test_aborting_the_parent_aborts_every_child(llm):
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(n=3, max_tokens=30, ignore_eos=True))
    engine.step()
    assert sorted(engine.scheduler.requests) == ["a#0", "a#1", "a#2"]
    engine.abort_request("a")
    assert not engine.scheduler.requests and not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_stop_string_finishes_one_choice_only(llm):
    engine = llm.engine
    greedy = SamplingParams(n=2, temperature=0, max_tokens=16, ignore_eos=True)
    text = llm.generate([{"prompt_token_ids": [9, 10, 11]}], greedy, use_tqdm=False)[0].outputs[0].text
    stop = next(
        text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].strip() and "\ufffd" not in text[i : i + 2]
    )
    seeded = SamplingParams(n=2, temperature=0, max_tokens=16, ignore_eos=True, stop=[stop])
    out = llm.generate([{"prompt_token_ids": [9, 10, 11]}], seeded, use_tqdm=False)[0]
    assert [(c.text, c.finish_reason, c.stop_reason) for c in out.outputs] == [
        (text[: text.index(stop)], "stop", stop)
    ] * 2
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks and not engine.scheduler.requests


def test_one_failed_child_fails_the_request_and_frees_its_siblings(llm):
    engine = llm.engine
    engine.add_request(
        "bad",
        {"prompt_token_ids": [9, 10, 11]},
        SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=12, ignore_eos=True),
    )
    engine.add_request("ok", {"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(temperature=0, max_tokens=12))
    engine.scheduler.requests["bad#1"].sampling_params.seed = 2**70  # the generator cannot take it
    final = _finish(engine)
    assert final["bad"].error is not None and not final["bad"].error.retryable
    assert [c.finish_reason for c in final["bad"].outputs] == ["error"] * 3
    assert final["ok"].error is None and len(final["ok"].outputs[0].token_ids) == 12
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks and not engine.scheduler.requests


def test_a_failed_first_step_leaves_no_poisoned_prompt_blocks(llm, model_factory):
    """The siblings hit child 0's prompt blocks in the very step that fails to compute them: those blocks
    must leave the prefix cache, or the retry would read KV that was never written."""
    engine = llm.engine
    prompt = [41] + list(range(200, 236))  # never seen by this engine; 2 full blocks
    params = SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True)
    real = engine.executor.execute
    calls = {"n": 0}

    def execute(sched):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected forward failure")
        return real(sched)

    engine.executor.execute = execute
    try:
        engine.add_request("f", {"prompt_token_ids": prompt}, params)
        assert _finish(engine)["f"].error == STEP_FAILED
    finally:
        del engine.executor.execute
    again = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    model_dir, _ = model_factory("llama_gqa")
    reference = LLM(model_dir, max_model_len=64, num_kv_blocks=64, block_size=16, max_num_seqs=4)
    expected = reference.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0]
    assert [c.token_ids for c in again.outputs] == [expected.outputs[0].token_ids] * 2


def test_n_above_max_num_seqs_is_refused_naming_n(llm):
    from kvserve.runtime.errors import InvalidParameter

    with pytest.raises(InvalidParameter) as info:
        llm.engine.add_request("big", [5, 6], SamplingParams(n=5))
    assert info.value.param == "n" and not llm.engine.has_unfinished_requests()

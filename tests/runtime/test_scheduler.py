"""Scheduler with fake requests and a fake runner: budgets, chunking, preemption, finish."""

from __future__ import annotations

from kvserve.runtime.core.kv_cache_manager import KVCacheManager
from kvserve.runtime.core.outputs import ModelRunnerOutput
from kvserve.runtime.core.scheduler import Scheduler, SchedulerConfig
from kvserve.runtime.request import Request, RequestStatus
from kvserve.runtime.sampling_params import SamplingParams

BS = 4


def make_scheduler(num_blocks=20, max_num_seqs=8, budget=16, chunked=True, max_model_len=64):
    kv = KVCacheManager(num_blocks, BS)
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
    )
    return Scheduler(cfg, kv)


def req(rid, n_prompt, max_tokens=4, **kw):
    base = 100 * ord(rid[0])  # distinct prompts per request letter: no accidental prefix hits
    return Request(
        rid,
        list(range(base, base + n_prompt)),
        SamplingParams(max_tokens=max_tokens, **kw),
        eos_token_ids=frozenset({2}),
    )


def fake_run(sched_out, token=7):
    """Every request that samples gets `token`."""
    return ModelRunnerOutput({s.req_id: token for s in sched_out.scheduled if s.sample})


def step(s: Scheduler, token=7):
    out = s.schedule()
    return out, s.update_from_output(out, fake_run(out, token))


def test_chunked_prefill_mixes_with_decodes_under_budget():
    s = make_scheduler(budget=16)
    s.add_request(req("a", 6))
    out, _ = step(s)
    assert [(x.req_id, len(x.token_ids)) for x in out.scheduled] == [("a", 6)]
    s.add_request(req("b", 40))
    out, res = step(s)
    # a decodes (1 token) first, then b's prompt is chunked to the remaining 15.
    assert [(x.req_id, len(x.token_ids)) for x in out.scheduled] == [("a", 1), ("b", 15)]
    assert not out.scheduled[1].sample  # mid-prefill: no sampling
    out, _ = step(s)
    assert [(x.req_id, len(x.token_ids), x.start_position) for x in out.scheduled] == [("a", 1, 7), ("b", 15, 15)]
    out, _ = step(s)
    assert [(x.req_id, len(x.token_ids)) for x in out.scheduled] == [("a", 1), ("b", 10)]
    assert out.scheduled[1].sample


def test_no_chunking_waits_for_room():
    s = make_scheduler(budget=64, chunked=False)
    s.add_request(req("a", 10))
    s.add_request(req("b", 60))
    out, _ = step(s)
    assert [x.req_id for x in out.scheduled] == ["a"]  # b (60) does not fit the remaining 54
    out, _ = step(s)  # next step: a's decode (1) + all of b (60) fit 64
    assert [(x.req_id, len(x.token_ids)) for x in out.scheduled] == [("a", 1), ("b", 60)]


def test_max_num_seqs():
    s = make_scheduler(max_num_seqs=2, budget=100)
    for i in range(3):
        s.add_request(req(f"r{i}", 4))
    out, _ = step(s)
    assert [x.req_id for x in out.scheduled] == ["r0", "r1"]
    assert s.num_waiting == 1


def test_finish_on_length_frees_blocks_same_step():
    s = make_scheduler()
    s.add_request(req("a", 4, max_tokens=2))
    step(s)
    assert s.kv.get_block_ids("a") == [1]  # 4 prompt tokens fill block 1
    _, res = step(s)
    assert res[0].finish_reason == "length"
    assert s.kv.get_block_ids("a") == [] and s.kv.usage == 0.0
    assert not s.has_unfinished_requests()
    out = s.schedule()
    assert out.finished_req_ids == ["a"]


def test_eos_stops_unless_ignored_and_min_tokens():
    s = make_scheduler()
    s.add_request(req("a", 4, max_tokens=5))
    s.add_request(req("b", 4, max_tokens=5, ignore_eos=True))
    _, res = step(s, token=2)
    assert {r.req_id: r.finish_reason for r in res} == {"a": "stop", "b": None}


def test_preemption_recompute_and_resume():
    # 6 usable blocks of 4 tokens; two requests of 8 prompt tokens growing to 16 tokens each.
    s = make_scheduler(num_blocks=7, budget=64)
    s.add_request(req("a", 8, max_tokens=8))
    s.add_request(req("b", 8, max_tokens=8))
    out, _ = step(s)
    assert s.kv.get_block_ids("a") == [1, 2] and s.kv.get_block_ids("b") == [3, 4]
    step(s)  # a: 9 tokens needs block 5, b: block 6
    assert s.kv.num_free_blocks == 0
    for _ in range(3):
        step(s)
    # At 13 tokens a needs a 4th block: none free -> b (last) is preempted.
    out = s.schedule()
    assert out.num_preempted == 1 and s.num_preemptions == 1
    assert s.requests["b"].status == RequestStatus.PREEMPTED and s.requests["b"].num_computed_tokens == 0
    assert [x.req_id for x in out.scheduled] == ["a"]
    s.update_from_output(out, fake_run(out))
    while s.requests.get("a"):
        step(s)
    # b comes back from its own cached full blocks: it had 3, but its tail one was evicted first (tail-first
    # freeing) when a took a 4th block, so 2 blocks (8 tokens) hit and 5 tokens are recomputed.
    out = s.schedule()
    b = s.requests["b"]
    assert b.status == RequestStatus.RUNNING and b.num_computed_tokens == 8
    assert [(x.req_id, len(x.token_ids)) for x in out.scheduled] == [("b", 5)]
    s.update_from_output(out, fake_run(out))
    while s.has_unfinished_requests():
        step(s)
    assert s.kv.usage == 0.0


def test_abort_waiting_and_running():
    s = make_scheduler()
    s.add_request(req("a", 4))
    s.add_request(req("b", 4))
    step(s)
    s.add_request(req("c", 4))
    finished = s.finish_requests(["a", "c", "nope"], RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in finished} == {"a", "c"}
    assert s.num_running == 1 and s.num_waiting == 0
    assert s.kv.get_block_ids("a") == []


def test_swap_preemption_moves_blocks_to_host_and_back_first():
    kv = KVCacheManager(7, BS, num_host_blocks=8)
    s = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, preemption_mode="swap"), kv
    )
    s.add_request(req("a", 8, max_tokens=8))
    s.add_request(req("b", 8, max_tokens=8))
    for _ in range(5):
        step(s)
    out = s.schedule()  # a needs a 4th block: b is swapped out, keeping its computed tokens
    b = s.requests["b"]
    assert b.status == RequestStatus.SWAPPED and b.num_computed_tokens == 12
    assert out.swap_out == [(3, 0), (4, 1), (6, 2)]  # b held device blocks 3, 4, 6
    assert [h for _, h in out.swap_out] == kv.req_to_host_blocks["b"]
    assert s.num_waiting == 1 and s.num_swap_outs == 1
    s.add_request(req("c", 4))  # must not jump ahead of the swapped request
    s.update_from_output(out, fake_run(out))
    while "a" in s.requests:
        out, _ = step(s)
        assert all(x.req_id != "c" for x in out.scheduled)
    out = s.schedule()
    assert [x.req_id for x in out.scheduled][0] == "b" and len(out.swap_in) == 3
    assert [x.req_id for x in out.scheduled] == ["b", "c"]
    assert b.status == RequestStatus.RUNNING and out.scheduled[0].start_position == 12
    s.update_from_output(out, fake_run(out))
    while s.has_unfinished_requests():
        step(s)
    assert kv.num_free_blocks == 6 and kv.num_free_host_blocks == 8

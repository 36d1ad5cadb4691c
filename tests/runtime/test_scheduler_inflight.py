"""Micro-batches (pipeline parallelism): the scheduler with batches in flight, at block level, fake runner.

A request in a launched batch is not scheduled again, nor preempted, until that batch's output is applied;
the active requests are split over `micro_batches` batches; max_num_seqs counts the in-flight ones; the
block-table diffs, applied by a fake runner in launch order, rebuild the KV manager's tables; and with a
runner whose token depends only on (request, position), every request's output equals one-batch-at-a-time
scheduling, under chunked prefill, prefix hits, recompute and swap preemption."""

from __future__ import annotations

import random
from collections import deque

import pytest

from kvserve.runtime.core.kv_cache_manager import KVCacheManager
from kvserve.runtime.core.outputs import ModelRunnerOutput
from kvserve.runtime.core.scheduler import Scheduler, SchedulerConfig
from kvserve.runtime.request import Request, RequestStatus
from kvserve.runtime.sampling_params import SamplingParams

BS = 4
EOS = 2


def make(micro_batches=2, num_blocks=40, max_num_seqs=8, budget=32, mode="recompute", caching=True, host_blocks=0):
    kv = KVCacheManager(num_blocks, BS, caching, num_host_blocks=host_blocks)
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=64, preemption_mode=mode
    )
    return Scheduler(cfg, kv, micro_batches=micro_batches)


def req(rid: str, prompt: list[int], max_tokens: int = 6) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), frozenset({EOS}))


def token_for(rid: str, position: int) -> int:
    """The fake model: the next token depends only on the request and its length (not on batching)."""
    return 3 + (sum(map(ord, rid)) * 31 + position * 7) % 47


def run_output(out, s: Scheduler) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        {
            x.req_id: token_for(x.req_id, x.start_position + len(x.token_ids))
            for x in out.scheduled
            if x.sample and x.req_id in s.requests
        }
    )


class FakeRunner:
    """The runner's tables, patched from the diffs in launch order (what every pipeline rank does)."""

    def __init__(self):
        self.tables: dict[str, list[int]] = {}

    def apply(self, out) -> None:
        for rid in out.finished_req_ids:
            self.tables.pop(rid, None)
        for x in out.scheduled:
            assert x.block_table.reset or x.req_id in self.tables, f"{x.req_id}: a patch for a table it lacks"
            self.tables[x.req_id] = x.block_table.apply(self.tables.get(x.req_id, []))


def test_active_requests_are_split_over_the_batches_and_in_flight_ones_are_skipped():
    s = make(budget=64)
    for rid in "abcd":
        s.add_request(req(rid, list(range(10 * ord(rid), 10 * ord(rid) + 6))))
    first = s.schedule()
    second = s.schedule()
    assert [x.req_id for x in first.scheduled] == ["a", "b"]  # ceil(4 active / 2 batches)
    assert [x.req_id for x in second.scheduled] == ["c", "d"]
    assert s.num_in_flight == 4
    third = s.schedule()  # everything is in flight: nothing to schedule, nothing rescheduled
    assert third.scheduled == [] and third.new_requests == []
    s.update_from_output(first, run_output(first, s))
    again = s.schedule()
    assert [(x.req_id, x.start_position, len(x.token_ids)) for x in again.scheduled] == [("a", 6, 1), ("b", 6, 1)]
    assert [r.request_id for r in s.running] == ["a", "b", "c", "d"]  # admission order kept
    s.update_from_output(second, run_output(second, s))
    assert s.num_in_flight == 2  # a and b (in `again`)


def test_a_chunked_prefill_continues_only_after_its_chunk_is_applied():
    s = make(budget=8)
    s.add_request(req("a", list(range(100, 120))))
    s.add_request(req("b", list(range(200, 220))))
    first, second = s.schedule(), s.schedule()
    assert [(x.req_id, x.start_position, len(x.token_ids)) for x in first.scheduled] == [("a", 0, 8)]
    assert [(x.req_id, x.start_position, len(x.token_ids)) for x in second.scheduled] == [("b", 0, 8)]
    s.update_from_output(first, run_output(first, s))
    nxt = s.schedule()
    assert [(x.req_id, x.start_position, len(x.token_ids)) for x in nxt.scheduled] == [("a", 8, 8)]


def test_max_num_seqs_counts_the_in_flight_requests():
    s = make(max_num_seqs=3, budget=64)
    for rid in "abcde":
        s.add_request(req(rid, [ord(rid)] * 5))
    first = s.schedule()  # ceil(min(5, 3) / 2) = 2
    second = s.schedule()  # one more seat left
    assert [x.req_id for x in first.scheduled] == ["a", "b"]
    assert [x.req_id for x in second.scheduled] == ["c"]
    assert s.schedule().scheduled == []
    assert s.num_waiting == 2


def test_in_flight_requests_are_never_preempted():
    """The pool runs dry while the newest running request is in flight: one batch at a time would preempt it
    (victims come from the tail); with micro-batches the request needing the block preempts itself instead,
    and the in-flight one keeps the blocks the pipeline is writing."""
    s = make(num_blocks=6, budget=64)  # 5 usable blocks
    s.add_request(req("b", list(range(200, 208))))  # 2 full blocks: its first decode needs a 3rd
    s.add_request(req("a", list(range(100, 111))))  # 3 blocks, a free slot left in the last one
    first, second = s.schedule(), s.schedule()
    assert [x.req_id for x in first.scheduled] == ["b"] and [x.req_id for x in second.scheduled] == ["a"]
    assert s.kv.num_free_blocks == 0
    a_blocks = s.kv.get_block_ids("a")
    s.update_from_output(first, run_output(first, s))
    third = s.schedule()  # b needs a block; a, the tail, is in flight
    assert third.scheduled == [] and third.num_preempted == 1
    assert s.requests["b"].status == RequestStatus.PREEMPTED
    assert s.requests["a"].status == RequestStatus.RUNNING and s.kv.get_block_ids("a") == a_blocks
    assert [r.request_id for r in s.running] == ["a"]
    s.update_from_output(second, run_output(second, s))
    fourth = s.schedule()
    assert [(x.req_id, x.start_position) for x in fourth.scheduled] == [("a", 11)]


SEEDS = range(12)


@pytest.mark.parametrize("seed", SEEDS)
def test_two_batches_in_flight_match_one_batch_at_a_time(seed):
    run_pair(seed)


def test_the_workloads_reach_preemption_swaps_and_prefix_hits_with_batches_in_flight():
    """Guards the test above against workloads too easy to exercise what in-flight batches complicate."""
    runs = [run_pair(seed) for seed in SEEDS]
    assert sum(s.num_preemptions - s.num_swap_outs for s in runs) > 0  # by recompute
    assert sum(s.num_swap_outs for s in runs) > 0
    assert sum(s.kv.prefix_cache_hits for s in runs) > 0


def run_pair(seed: int) -> Scheduler:
    """One random workload, one batch at a time and two in flight: the same tokens; returns the second."""
    rng = random.Random(seed)
    mode = rng.choice(["recompute", "swap"])
    cfg = dict(
        num_blocks=rng.randrange(14, 30),
        max_num_seqs=rng.randrange(2, 9),
        budget=rng.randrange(8, 40),
        mode=mode,
        caching=rng.random() < 0.7,
        host_blocks=rng.randrange(4, 30) if mode == "swap" else 0,
    )
    shared = [rng.randrange(3, 50) for _ in range(12)]
    workload = []
    for i in range(12):
        prompt = (shared[: rng.randrange(0, 12)] if rng.random() < 0.5 else []) + [
            rng.randrange(3, 50) for _ in range(rng.randrange(1, 14))
        ]
        workload.append((f"r{i}", prompt, rng.randrange(1, 16)))
    arrivals = [rng.choice([0, 0, 1, 2]) for _ in range(4000)]

    reference = _outputs(make(micro_batches=1, **cfg), workload, arrivals, in_flight=1)
    pipelined, s = _outputs(make(micro_batches=2, **cfg), workload, arrivals, in_flight=2, check=True)
    assert pipelined == reference
    assert s.num_in_flight == 0 and not s.running and not s.requests
    return s


def _outputs(s: Scheduler, workload, arrivals, in_flight: int, check: bool = False):
    """Run the workload keeping `in_flight` batches launched; returns each request's tokens (and s if check)."""
    pending = deque(workload)
    runner = FakeRunner()
    queue: deque = deque()  # (launched output, each request's block ids at launch)
    tokens: dict[str, list[int]] = {}
    max_batches = 0
    for step in range(4000):
        for _ in range(arrivals[step]):
            if pending:
                rid, prompt, max_tokens = pending.popleft()
                s.add_request(req(rid, prompt, max_tokens))
        launched = False
        if len(queue) < in_flight:
            out = s.schedule()
            if out.scheduled or out.swap_out or out.swap_in or out.finished_req_ids:
                runner.apply(out)
                ids = [x.req_id for x in out.scheduled]
                if check:
                    busy = {rid for o, _ in queue for rid in (x.req_id for x in o.scheduled)}
                    assert not busy & set(ids), f"step {step}: a request in two batches in flight"
                    for rid in ids:
                        assert runner.tables[rid] == s.kv.get_block_ids(rid), f"step {step}: {rid}"
                queue.append((out, {rid: list(s.kv.get_block_ids(rid)) for rid in ids}))
                max_batches = max(max_batches, len(queue))
                launched = True
        if queue and (len(queue) == in_flight or not launched):
            out, blocks_at_launch = queue.popleft()
            if check:  # the blocks this batch wrote are still its requests' own
                for rid, blocks in blocks_at_launch.items():
                    assert s.kv.get_block_ids(rid)[: len(blocks)] == blocks, f"step {step}: {rid}"
            for o in s.update_from_output(out, run_output(out, s)):
                tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
        if not pending and not queue and not s.has_unfinished_requests():
            break
    assert not s.has_unfinished_requests() and not pending
    assert sorted(tokens) == sorted(rid for rid, _, _ in workload)
    if check:
        assert max_batches == in_flight
        return tokens, s
    return tokens

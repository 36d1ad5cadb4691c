"""The pure-decode fast path and the block-table diffs, on randomized fake-request workloads at block level.

Two schedulers run the same workload in lockstep, one with the fast paths (the scheduler's and the KV manager's
allocate_slots shortcut) switched off: every step's output
(ids, tokens, positions, table diffs, samples, swaps) and the KV state (each request's block ids,
ref counts, the free queue's order) must be identical. A fake runner applies the diffs the way the model
runner does; its tables must equal the KV manager's for every scheduled request, every step."""

from __future__ import annotations

import random

import pytest

from kvserve.runtime.core.block_table_diff import BlockTableDiff, SentBlockTables
from kvserve.runtime.core.kv_cache_manager import KVCacheManager
from kvserve.runtime.core.outputs import ModelRunnerOutput
from kvserve.runtime.core.scheduler import Scheduler, SchedulerConfig
from kvserve.runtime.engine.parent_request import ParentRequest
from kvserve.runtime.request import Request, RequestStatus
from kvserve.runtime.sampling_params import SamplingParams

BS = 4
EOS = 2


class FakeRunnerTables:
    """The runner's side of the protocol: tables patched from diffs, dropped on finish."""

    def __init__(self):
        self.tables: dict[str, list[int]] = {}

    def apply(self, out) -> None:
        for rid in out.finished_req_ids:
            self.tables.pop(rid, None)
        for s in out.scheduled:
            diff = s.block_table
            assert diff.reset or s.req_id in self.tables, f"{s.req_id}: a patch for a table the runner lacks"
            self.tables[s.req_id] = diff.apply(self.tables.get(s.req_id, []))


def make(
    num_blocks: int, max_num_seqs: int, budget: int, mode: str, caching: bool, fast: bool, num_host_blocks: int
) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, caching, num_host_blocks=num_host_blocks if mode == "swap" else 0)
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=64, preemption_mode=mode
    )
    s = Scheduler(cfg, kv)
    if not fast:  # the reference: the scheduler's general path and the KV manager's general allocate_slots
        s._schedule_decodes = lambda scheduled, scheduled_reqs: 0
        kv.decode_fast_path = False
    return s


def make_requests(rng: random.Random, num: int) -> list[list[Request]]:
    """num user requests, each as the child requests the front queues for it (n of them for n samples)."""
    shared = [rng.randrange(3, 50) for _ in range(12)]  # some prompts share prefixes (prefix-cache hits)
    reqs = []
    for i in range(num):
        prompt = (shared[: rng.randrange(0, 12)] if rng.random() < 0.5 else []) + [
            rng.randrange(3, 50) for _ in range(rng.randrange(1, 14))
        ]
        n = rng.choice([1, 1, 1, 2, 3])
        params = SamplingParams(max_tokens=rng.randrange(1, 20), n=n)
        reqs.append(
            [
                Request(child.request_id, prompt, child.params, frozenset({EOS}))
                for child in ParentRequest(f"q{i}", params).children
            ]
        )
    return reqs


def state_of(s: Scheduler):
    kv = s.kv
    return (
        {rid: [(b.block_id, b.ref_cnt) for b in blocks] for rid, blocks in kv.req_to_blocks.items()},
        kv.pool.free_queue.block_ids(),
        [r.request_id for r in s.running],
        [r.request_id for r in s.waiting],
        [r.request_id for r in s.swapped],
    )


def out_of(out):
    return (
        [(x.req_id, x.token_ids, x.start_position, x.block_table, x.sample) for x in out.scheduled],
        [n.req_id for n in out.new_requests],
        out.finished_req_ids,
        out.swap_out,
        out.swap_in,
        out.num_preempted,
    )


SEEDS = range(16)


@pytest.mark.parametrize("seed", SEEDS)
def test_fast_path_matches_general_path(seed):
    run_lockstep(seed)


def test_the_workloads_reach_preemption_swaps_shared_samples_and_prefix_hits():
    """Guards the test above against workloads too easy to exercise the paths the fast path hands over."""
    runs = [run_lockstep(seed) for seed in SEEDS]
    assert sum(s.num_preemptions - s.num_swap_outs for s, _ in runs) > 0  # by recompute
    assert sum(s.num_swap_outs for s, _ in runs) > 0
    assert sum(s.kv.prefix_cache_hits for s, _ in runs) > 0
    assert sum(num_shared for _, num_shared in runs) > 0  # n > 1 siblings held the same prompt blocks


def run_lockstep(seed: int) -> tuple[Scheduler, int]:
    """Run one random workload through both schedulers, asserting at every step; returns the fast one and
    in how many steps two children of one request held a common block."""
    rng = random.Random(seed)
    mode = rng.choice(["recompute", "swap"])
    config = dict(
        num_blocks=rng.randrange(14, 28),
        max_num_seqs=rng.randrange(2, 10),
        budget=rng.randrange(8, 40),
        mode=mode,
        caching=rng.random() < 0.7,
        num_host_blocks=rng.randrange(4, 30),
    )
    fast, slow = make(fast=True, **config), make(fast=False, **config)
    workload = make_requests(rng, 14)
    pending = list(workload)
    runner = FakeRunnerTables()
    num_fast_decodes = num_shared = 0
    for step in range(3000):
        for _ in range(rng.choice([0, 0, 1, 2])):  # arrivals spread over the run
            if pending:
                for r in pending.pop(0):  # a request's children, back to back
                    fast.add_request(r)
                    slow.add_request(_clone(r))
        if rng.random() < 0.05 and fast.requests:  # an abort now and then
            abort(fast, slow, rng.choice(sorted(fast.requests)))
        out_fast, out_slow = fast.schedule(), slow.schedule()
        assert out_of(out_fast) == out_of(out_slow), f"step {step}"
        assert state_of(fast) == state_of(slow), f"step {step}"
        runner.apply(out_fast)
        for x in out_fast.scheduled:
            assert runner.tables[x.req_id] == fast.kv.get_block_ids(x.req_id), f"step {step}: {x.req_id}"
        num_fast_decodes += sum(len(x.token_ids) == 1 for x in out_fast.scheduled)
        num_shared += _siblings_share_a_block(fast)
        # The same sampled token for both (EOS now and then); a rare failed sample gets no token.
        tokens = {
            rid: (EOS if rng.random() < 0.05 else rng.randrange(3, 50))
            for x in out_fast.scheduled
            if x.sample
            for rid in [x.req_id]
            if rng.random() > 0.01
        }
        res_fast = fast.update_from_output(out_fast, ModelRunnerOutput(dict(tokens)))
        res_slow = slow.update_from_output(out_slow, ModelRunnerOutput(dict(tokens)))
        assert [(o.req_id, o.new_token_ids, o.finish_reason) for o in res_fast] == [
            (o.req_id, o.new_token_ids, o.finish_reason) for o in res_slow
        ]
        for rid in sorted({x.req_id for x in out_fast.scheduled if x.sample} - tokens.keys()):
            abort(fast, slow, rid)  # what the engine does with a request whose sampling failed
        if not pending and not fast.has_unfinished_requests():
            break
    assert not fast.has_unfinished_requests() and not slow.has_unfinished_requests()
    assert num_fast_decodes > 0
    return fast, num_shared


def _siblings_share_a_block(s: Scheduler) -> bool:
    held: dict[int, set[str]] = {}
    for rid, blocks in s.kv.req_to_blocks.items():
        for b in blocks:
            held.setdefault(b.block_id, set()).add(rid)
    return any(len({rid.split("#")[0] for rid in rids}) < len(rids) for rids in held.values())


def abort(fast: Scheduler, slow: Scheduler, sample_id: str) -> None:
    """As the front aborts a request (or one of its children failed): every child still in the core."""
    public = sample_id.split("#")[0]
    sample_ids = sorted(rid for rid in fast.requests if rid.split("#")[0] == public)
    for s in (fast, slow):
        s.finish_requests(sample_ids, RequestStatus.FINISHED_ABORTED)


def _clone(r: Request) -> Request:
    return Request(r.request_id, r.prompt_token_ids, r.sampling_params, r.eos_token_ids, r.arrival_time)


def test_diff_appends_then_replaces_then_resets():
    class B:
        def __init__(self, i):
            self.block_id = i

    b = [B(i) for i in range(8)]
    sent, runner = SentBlockTables(), []
    d = sent.diff("a", [b[1], b[2]])
    assert (d.reset, d.appended) == (True, [1, 2])
    runner = d.apply(runner)
    assert sent.diff("a", [b[1], b[2]]) == BlockTableDiff()  # unchanged: nothing to send
    d = sent.diff("a", [b[1], b[2], b[3]])
    assert (d.reset, d.replaced, d.appended) == (False, [], [3])
    runner = d.apply(runner)
    # A sliding-window group swaps a block that left the window for the null block, and grows.
    d = sent.diff("a", [b[0], b[2], b[3], b[4]])
    assert (d.reset, d.replaced, d.appended) == (False, [(0, 0)], [4])
    runner = d.apply(runner)
    assert runner == [0, 2, 3, 4]
    d = sent.diff("a", [b[5]])  # shorter than what the runner holds: sent whole
    assert (d.reset, d.appended) == (True, [5])
    assert d.apply(runner) == [5]
    sent.forget("a")
    assert "a" not in sent and sent.diff("a", [b[6]]).reset


def test_decode_steps_send_no_whole_tables():
    """What TP pickles to every rank each step stays O(changes): a long request's decodes send nothing but
    the one new block id when a block fills up, never its table again."""
    s = make(num_blocks=40, max_num_seqs=2, budget=64, mode="recompute", caching=True, fast=True, num_host_blocks=0)
    s.add_request(Request("long", list(range(3, 43)), SamplingParams(max_tokens=20, ignore_eos=True)))
    out = s.schedule()
    assert out.scheduled[0].block_table.reset and len(out.scheduled[0].block_table.appended) == 10
    diffs = []
    while s.has_unfinished_requests():
        s.update_from_output(out, ModelRunnerOutput({"long": 7}))
        out = s.schedule()
        diffs += [x.block_table for x in out.scheduled]
    assert all(not d.reset and not d.replaced and len(d.appended) <= 1 for d in diffs)
    # 40 prompt tokens + 19 decoded ones get KV (the 20th sampled token finishes it): 15 blocks of 4.
    assert sum(len(d.appended) for d in diffs) == 15 - 10

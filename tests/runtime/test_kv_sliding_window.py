"""Sliding-window KV cache groups at block level: out-of-window blocks are freed while decoding, a prefix
hit needs only the window's blocks, hashes survive the freeing, and the scheduler drives it end to end."""

from __future__ import annotations

from kvserve.runtime.core import sliding_window
from kvserve.runtime.core.kv_cache_manager import KVCacheManager
from kvserve.runtime.core.scheduler import Scheduler, SchedulerConfig
from kvserve.runtime.request import Request
from kvserve.runtime.sampling_params import SamplingParams

BS = 4
W = 6  # the query at p sees p-5..p: before a step at position c, blocks wholly below c - 5 are dead


def make_request(rid: str, tokens: list[int], max_tokens: int = 100) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def run_step(kv: KVCacheManager, req: Request, num_new: int, hits=()) -> None:
    assert kv.allocate_slots(req, num_new, hits) is not None
    req.num_computed_tokens += num_new


def test_block_arithmetic():
    assert sliding_window.num_skipped_blocks(9, W, BS) == 1  # positions 0..3 < 9 - 5: block 0 is dead
    assert sliding_window.num_skipped_blocks(8, W, BS) == 0  # position 3 is still in 8's window
    assert sliding_window.num_skipped_blocks(100, 0, BS) == 0  # full attention keeps everything
    assert sliding_window.num_window_blocks(W, BS) == 2
    cached = {0, 1, 3, 4, 6}
    # right to left: [3, 4] is the last run of 2 -> L = 5; a full group stops at the first miss (L = 2)
    assert sliding_window.longest_hit(cached.__contains__, 8, W, BS) == 5
    assert sliding_window.longest_hit(cached.__contains__, 8, 0, BS) == 2
    assert sliding_window.longest_hit({0}.__contains__, 8, W, BS) == 1  # the window reaches the start


def test_decoding_frees_out_of_window_blocks_per_group():
    kv = KVCacheManager(num_blocks=20, block_size=BS, group_windows=(0, W))
    req = make_request("a", list(range(100, 110)))  # 10 tokens: 3 blocks in each group
    run_step(kv, req, 10)
    assert kv.get_block_ids("a") == [1, 2, 3] and kv.get_group_block_ids("a") == ([4, 5, 6],)
    for token in range(30):  # decode 30 tokens
        req.append_token(token)
        run_step(kv, req, 1)
    n = req.num_computed_tokens  # 40 tokens computed: the next query (position 40) sees 35..40
    assert n == 40
    full, (sliding,) = kv.get_block_ids("a"), kv.get_group_block_ids("a")
    assert len(full) == 10  # the global group keeps every block
    assert sliding[:8] == [0] * 8  # blocks 0..7 (positions < 32) were freed ...
    assert all(b > 0 for b in sliding[8:]) and len(sliding) == 10  # ... while 8, 9 are in the window
    # the pool got the freed blocks back: 19 usable - 10 full - 2 sliding, + room for block 10 when needed
    assert kv.num_free_blocks == 19 - 10 - 2
    kv.free(req)
    assert kv.num_free_blocks == 19


def test_freed_sliding_blocks_keep_hashes_and_a_hit_needs_only_the_window():
    kv = KVCacheManager(num_blocks=40, block_size=BS, group_windows=(0, W))
    prompt = list(range(200, 224))  # 24 tokens = 6 full blocks
    a = make_request("a", prompt)
    run_step(kv, a, 24)
    sliding_a = kv.get_group_block_ids("a")[0]
    for t in range(4):
        a.append_token(t)
        run_step(kv, a, 1)  # the step at position 27 sees 22..27: sliding blocks 0..4 are freed
    assert kv.get_group_block_ids("a")[0][:5] == [0] * 5 and kv.get_group_block_ids("a")[0][5] == sliding_a[5]
    assert all(kv.pool.blocks[i].ref_cnt == 0 and kv.pool.blocks[i].block_hash for i in sliding_a[:5])
    b = make_request("b", prompt + [999])  # same 24-token prefix: the hit may use all 6 blocks
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 24
    # The full group hits all six; the sliding group needs only blocks 4 and 5 (the next query, position
    # 24, sees 19..24) -- block 4 was freed from "a" but kept its hash -- and null placeholders before them.
    assert [blk.block_id for blk in hits] == kv.get_block_ids("a")[:6]
    assert [blk.block_id for blk in hits.groups[1]] == [0, 0, 0, 0] + sliding_a[4:6]
    run_step(kv, b, 1, hits)
    b.num_computed_tokens = 25
    assert kv.get_group_block_ids("b")[0][:4] == [0] * 4


def test_hit_length_is_what_every_group_can_serve():
    kv = KVCacheManager(num_blocks=40, block_size=BS, group_windows=(0, W))
    prompt = list(range(300, 324))
    a = make_request("a", prompt)
    run_step(kv, a, 24)
    sliding_a = kv.get_group_block_ids("a")[0]
    kv.free(a)  # every block free but still cached, in both groups
    for i in (4, 5):  # the sliding group's window for a 6-block hit is evicted (the full group keeps its copy)
        kv.pool.uncache_block(kv.pool.blocks[sliding_a[i]])
    b = make_request("b", prompt + [1])
    hits, num_hit = kv.get_computed_blocks(b)
    # Sliding blocks 4, 5 gone: the longest run of 2 cached sliding blocks ends at block 4 -> 16 tokens.
    assert num_hit == 16 and len(hits) == 4 and len(hits.groups[1]) == 4


def test_scheduler_holds_about_a_window_for_the_sliding_group():
    """A long decode through the scheduler: the full group grows with the sequence, the sliding group stays
    within cdiv(W - 1 + tokens per step, BS) + 1 blocks."""
    kv = KVCacheManager(num_blocks=64, block_size=BS, group_windows=(0, W))
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_model_len=200), kv)
    req = make_request("r", list(range(400, 430)), max_tokens=60)
    sched.add_request(req)
    peak_sliding = 0
    from kvserve.runtime.core.outputs import ModelRunnerOutput

    full_tables, sliding_tables = {}, {}  # as the runner holds them, patched from the step's diffs
    num_null_replacements = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        for s in out.scheduled:
            full = full_tables[s.req_id] = s.block_table.apply(full_tables.get(s.req_id, []))
            (diff,) = s.group_block_tables
            num_null_replacements += sum(1 for _, block_id in diff.replaced if block_id == 0)
            sliding = sliding_tables[s.req_id] = diff.apply(sliding_tables.get(s.req_id, []))
            assert (full, sliding) == (kv.get_block_ids(s.req_id), kv.get_group_block_ids(s.req_id)[0])
            assert len(full) == -(-(s.start_position + len(s.token_ids)) // BS)
            live = [b for b in sliding if b]
            peak_sliding = max(peak_sliding, len(live))
            # every block the step's queries can read is live: from the first query's window start
            first_live = max(0, s.start_position - W + 1) // BS
            assert all(sliding[first_live:]) and not any(sliding[:first_live])
        sched.update_from_output(out, ModelRunnerOutput({s.req_id: 7 for s in out.scheduled if s.sample}))
    assert peak_sliding <= -(-(W - 1 + 8) // BS) + 1
    assert num_null_replacements > 0  # blocks that left the window reach the runner as in-place null entries
    assert kv.num_free_blocks == 63

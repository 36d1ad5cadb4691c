"""The host block pool and the host tier's scheduler half (torch-free): LRU with promotion, pinning against
eviction, saves invisible until reported done, swap outranking the cache, KV events with medium CPU."""

from __future__ import annotations

import pytest

from kvserve.runtime.core.block_pool import BlockPool
from kvserve.runtime.core.host_pool import MEDIUM_HOST, HostBlockPool
from kvserve.runtime.core.kv_cache_events import KVEventCollector, RemovedBlocks, StoredBlocks
from kvserve.runtime.core.kv_cache_manager import KVCacheManager
from kvserve.runtime.core.outputs import ModelRunnerOutput
from kvserve.runtime.core.scheduler import Scheduler, SchedulerConfig
from kvserve.runtime.request import Request, RequestStatus
from kvserve.runtime.sampling_params import SamplingParams


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def saved(pool: HostBlockPool, i: int) -> int:
    slot = pool.reserve_for_save(h(i), (i,), None)
    pool.commit([slot])
    return slot


def test_lru_evicts_least_recent_and_a_hit_promotes():
    pool = HostBlockPool(2, tier_enabled=True)
    saved(pool, 1), saved(pool, 2)
    assert pool.lookup([h(1)], [(1,)]) == 1
    pool.unpin(pool.pin_for_load([h(1)]))  # a load promotes block 1: block 2 is now the oldest
    saved(pool, 3)
    assert pool.lookup([h(1)], [(1,)]) == 1 and pool.lookup([h(2)], [(2,)]) == 0 and pool.num_evicted_blocks == 1


def test_pending_saves_are_invisible_and_pinned_entries_survive():
    pool = HostBlockPool(2, tier_enabled=True)
    slot = pool.reserve_for_save(h(1), (1,), None)
    assert pool.lookup([h(1)], [(1,)]) == 0 and pool.contains(h(1))
    pool.commit([slot])
    pinned = pool.pin_for_load([h(1)])
    saved(pool, 2)
    # Block 1 is pinned and block 2 pending-then-committed; a third save evicts 2, never the pinned 1.
    saved(pool, 3)
    assert pool.lookup([h(1)], [(1,)]) == 1 and pool.lookup([h(2)], [(2,)]) == 0
    assert pool.num_allocatable == 1  # block 3 (block 1 is pinned)
    pool.unpin(pinned)
    assert pool.num_allocatable == 2


def test_token_mismatch_is_a_miss():
    pool = HostBlockPool(1, tier_enabled=True)
    saved(pool, 1)
    assert pool.lookup([h(1)], [(2,)]) == 0


def test_swap_evicts_tier_entries_and_aborted_saves_free_their_slots():
    pool = HostBlockPool(3, tier_enabled=True)
    saved(pool, 1), saved(pool, 2)
    pending = pool.reserve_for_save(h(3), (3,), None)
    assert pool.num_allocatable == 2  # the pending entry is not evictable
    swap = pool.allocate(2)
    assert pool.num_tier_blocks == 1 and pool.lookup([h(1)], [(1,)]) == 0
    pool.abort([pending])
    assert pool.num_free_blocks == 1 and not pool.contains(h(3))
    pool.release(swap)
    assert pool.num_free_blocks == 3
    with pytest.raises(ValueError):
        pool.allocate(4)


def test_events_carry_medium_cpu_on_the_wire():
    from kvserve.runtime.kv_events.events import BlockRemoved, BlockStored, to_wire

    device = BlockPool(4)
    device.events = KVEventCollector()
    pool = HostBlockPool(1, tier_enabled=True)
    pool.event_source = device
    pool.commit([pool.reserve_for_save(h(1), (1,), None, lora_name="sql")])
    saved(pool, 2)  # evicts 1
    records = device.events.take()
    stored1, removed, stored2 = records
    assert isinstance(stored1, StoredBlocks) and stored1.medium == MEDIUM_HOST and stored1.token_ids == [1]
    assert stored1.lora_name == "sql"
    assert isinstance(removed, RemovedBlocks) and removed.medium == MEDIUM_HOST
    assert isinstance(stored2, StoredBlocks)
    wire = to_wire([*records, StoredBlocks([7], None, [1], 1)], "GPU")
    assert [type(e) for e in wire] == [BlockStored, BlockRemoved, BlockStored, BlockStored]
    assert [e.medium for e in wire] == ["CPU", "CPU", "CPU", "GPU"]  # a device record keeps the batch's medium


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), eos_token_ids=frozenset())


def _step(scheduler: Scheduler, out_tokens: dict[str, int] | None = None):
    """One schedule + an output that reports every connector transfer done (what the runner does)."""
    sched = scheduler.schedule()
    out = ModelRunnerOutput(
        out_tokens or {s.req_id: 7 for s in sched.scheduled if s.sample},
        finished_sending=set(sched.kv_connector.save),
        finished_receiving=set(sched.kv_connector.load),
    )
    scheduler.update_from_output(sched, out)
    return sched


def test_scheduler_saves_on_store_and_loads_after_device_eviction():
    bs = 4
    kv = KVCacheManager(num_blocks=5, block_size=bs, num_host_blocks=8, host_tier=True)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), kv)
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks
    scheduler.add_request(_request("a", prompt))
    first = _step(scheduler)
    assert first.kv_connector.save["a"].num_tokens == 3 * bs and not first.kv_connector.load
    assert kv.host.num_tier_blocks == 3
    # Another prompt fills the device pool: "a"'s cached blocks are evicted there.
    scheduler.add_request(_request("b", list(range(100, 116))))
    _step(scheduler)
    assert kv.get_computed_blocks(_request("probe", prompt))[1] == 0
    scheduler.add_request(_request("c", prompt))
    third = _step(scheduler)
    load = third.kv_connector.load["c"]
    assert load.num_tokens == 3 * bs and len(load.host_block_ids) == 3
    (sched_c,) = third.scheduled
    assert sched_c.start_position == 3 * bs and sched_c.token_ids == prompt[3 * bs :]
    assert scheduler.num_offload_loaded_tokens == 3 * bs
    assert kv.host.num_allocatable == kv.host.num_blocks  # unpinned once the step reported the load


def test_a_tier_hit_costs_no_token_budget_and_loads_in_its_admission_step():
    """Loaded tokens are a copy, not a forward: with a 4-token budget (chunked prefill) the 13-token prompt
    first takes 4 steps, and its repeat after device eviction one step -- 12 tokens loaded, the last
    computed, its first token sampled in the very step that admits it."""
    bs = 4
    kv = KVCacheManager(num_blocks=5, block_size=bs, num_host_blocks=8, host_tier=True)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=bs, max_model_len=64), kv)
    prompt = list(range(10, 23))
    scheduler.add_request(_request("a", prompt))
    num_steps = 0
    while scheduler.has_unfinished_requests():
        _step(scheduler)
        num_steps += 1
    assert num_steps == 4  # the budget binds: 4 + 4 + 4 + 1 tokens
    scheduler.add_request(_request("b", list(range(100, 116))))  # evicts a's blocks from the device
    while scheduler.has_unfinished_requests():
        _step(scheduler)
    assert kv.get_computed_blocks(_request("probe", prompt))[1] == 0
    scheduler.add_request(_request("c", prompt))
    step = _step(scheduler)
    (sched_c,) = step.scheduled
    assert step.kv_connector.load["c"].num_tokens == 3 * bs
    assert sched_c.start_position == 3 * bs and sched_c.token_ids == prompt[3 * bs :] and sched_c.sample
    assert not scheduler.has_unfinished_requests()  # max_tokens=1: finished in its admission step


@pytest.mark.parametrize("tier", [False, True])
def test_with_the_tier_a_swap_preemption_goes_through_the_tier(tier):
    """--preemption-mode swap: without the tier the victim is swapped out and in; with it (one mechanism) it
    is freed -- its full blocks are in the tier -- and comes back as a load, resuming where it stopped."""
    bs = 4
    kv = KVCacheManager(num_blocks=5, block_size=bs, num_host_blocks=8, host_tier=tier)
    config = SchedulerConfig(max_num_batched_tokens=64, max_model_len=64, preemption_mode="swap")
    scheduler = Scheduler(config, kv)
    for rid, first in (("a", 10), ("b", 40)):
        scheduler.add_request(
            Request(rid, list(range(first, first + 7)), SamplingParams(max_tokens=8), eos_token_ids=frozenset())
        )
    steps = [_step(scheduler) for _ in range(3)]  # both prefill and decode; b (newest) is preempted in step 3
    assert steps[2].num_preempted == 1 and [s.req_id for s in steps[2].scheduled] == ["a"]
    assert bool(steps[2].swap_out) is not tier and scheduler.num_swap_outs == (0 if tier else 1)
    for _ in range(20):  # a decodes alone until it finishes, then b comes back
        resumed = _step(scheduler)
        if "b" in resumed.kv_connector.load or resumed.swap_in:
            break
    else:
        pytest.fail("b never came back")
    (sched_b,) = resumed.scheduled
    assert sched_b.start_position == 2 * bs  # nothing recomputed: its two full blocks came back
    if tier:
        assert resumed.kv_connector.load["b"].num_tokens == 2 * bs and not kv.req_to_host_blocks


def test_a_step_without_output_is_aborted():
    bs = 4
    kv = KVCacheManager(num_blocks=5, block_size=bs, num_host_blocks=8, host_tier=True)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), kv)
    scheduler.add_request(_request("a", list(range(10, 23))))
    sched = scheduler.schedule()  # its step "fails": no output is applied
    assert sched.kv_connector.save
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    scheduler.schedule()
    assert kv.host.num_tier_blocks == 0 and kv.host.num_free_blocks == 8


def test_tier_off_is_todays_behaviour():
    kv = KVCacheManager(num_blocks=5, block_size=4, num_host_blocks=8)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), kv)
    scheduler.add_request(_request("a", list(range(10, 23))))
    assert scheduler.schedule().kv_connector.is_empty and kv.tier is None

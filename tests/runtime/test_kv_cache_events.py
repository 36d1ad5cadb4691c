"""The prefix cache's event records (core/kv_cache_events.py): exact hashes, tokens and order per step."""

from __future__ import annotations

from kvserve.runtime.core.block_hash import block_hashes
from kvserve.runtime.core.kv_cache_events import (
    AllCleared,
    KVEventCollector,
    RemovedBlocks,
    StoredBlocks,
    external_block_hash,
)
from kvserve.runtime.core.kv_cache_manager import KVCacheManager
from kvserve.runtime.request import Request
from kvserve.runtime.sampling_params import SamplingParams

BS = 4


def make_kv(num_blocks: int) -> KVCacheManager:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BS)
    kv.pool.events = KVEventCollector()
    return kv


def admit(kv: KVCacheManager, req: Request) -> None:
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens


def ext(tokens: list[int]) -> list[int]:
    return [external_block_hash(h) for h in block_hashes(tokens, BS)]


def test_external_hash_is_the_digests_low_64_bits():
    digest = bytes(range(16))
    assert external_block_hash(digest) == int.from_bytes(bytes(range(8, 16)), "big")
    assert external_block_hash(digest) < 2**64


def test_stored_then_hit_then_evicted():
    kv = make_kv(num_blocks=5)  # 4 usable blocks
    a = Request("a", list(range(10)), SamplingParams(max_tokens=4))
    admit(kv, a)
    # Two full blocks stored as one run from the prompt's root; the partial third block is not.
    assert kv.pool.events.take() == [StoredBlocks(ext(list(range(10))), None, list(range(8)), BS, None)]
    b = Request("b", list(range(8)) + [50, 51, 52, 53, 54], SamplingParams(max_tokens=4))
    kv.free(a)
    admit(kv, b)
    events = kv.pool.events.take()
    # b hits a's two blocks (no new stored for them), reuses a's third (unhashed) block and caches its own
    # third block, chained to a's second.
    chain = ext(b.all_token_ids)
    assert events == [StoredBlocks([chain[2]], chain[1], [50, 51, 52, 53], BS, None)]
    kv.free(b)
    c = Request("c", [7] * 12, SamplingParams(max_tokens=4))
    admit(kv, c)  # takes b's unhashed last block, then evicts b's cached third and second blocks
    events = kv.pool.events.take()
    assert events[0] == RemovedBlocks([chain[2], chain[1]])
    assert events[1] == StoredBlocks(ext([7] * 12), None, [7] * 12, BS, None)


def test_duplicate_block_is_not_announced_and_lora_name_is_carried():
    kv = make_kv(num_blocks=8)
    a = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4), lora_name="sql", lora_identity="sql@1")
    b = Request("b", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4), lora_name="sql", lora_identity="sql@1")
    a_hits, _ = kv.get_computed_blocks(a)
    b_hits, _ = kv.get_computed_blocks(b)  # looked up before a's block was cached: both miss
    kv.allocate_slots(a, a.num_tokens, a_hits)
    kv.allocate_slots(b, b.num_tokens, b_hits)  # b's identical block stays private: not announced
    events = kv.pool.events.take()
    assert len(events) == 1 and events[0].lora_name == "sql"
    assert events[0].token_ids == [1, 2, 3, 4]


def test_uncached_before_compute_is_removed_and_reset_clears():
    kv = make_kv(num_blocks=6)
    a = Request("a", list(range(8)) + [9], SamplingParams(max_tokens=4))
    hits, _ = kv.get_computed_blocks(a)
    kv.allocate_slots(a, a.num_tokens, hits)  # cached ahead of its step; the step fails: freed uncomputed
    kv.free(a)
    stored, removed = kv.pool.events.take()
    assert isinstance(stored, StoredBlocks) and removed == RemovedBlocks(stored.block_hashes)
    b = Request("b", list(range(8)), SamplingParams(max_tokens=4))
    admit(kv, b)
    assert not kv.pool.reset_prefix_cache()  # b still holds its blocks
    kv.free(b)
    kv.pool.events.take()
    assert kv.pool.reset_prefix_cache() and not kv.pool.cached_blocks
    assert kv.pool.events.take() == [AllCleared()]
    c = Request("c", list(range(8)), SamplingParams(max_tokens=4))
    admit(kv, c)  # nothing evicted after the reset is announced again as removed
    assert [type(e) for e in kv.pool.events.take()] == [StoredBlocks]


def test_off_by_default_records_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = Request("a", list(range(8)), SamplingParams(max_tokens=4))
    admit(kv, a)
    assert kv.pool.events is None and all(b.event_hash is None for b in kv.req_to_blocks["a"])

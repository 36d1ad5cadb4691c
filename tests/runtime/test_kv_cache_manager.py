"""KV cache manager and block pool at block level: exact block ids, ref counts, eviction order."""

from __future__ import annotations

import pytest

from kvserve.runtime.core.block_pool import BlockPool
from kvserve.runtime.core.kv_cache_manager import KVCacheManager
from kvserve.runtime.request import Request
from kvserve.runtime.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=100))


def admit(kv: KVCacheManager, req: Request, num_new: int | None = None):
    hits, num_hit = kv.get_computed_blocks(req)
    blocks = kv.allocate_slots(req, (req.num_tokens - num_hit) if num_new is None else num_new, hits)
    assert blocks is not None
    req.num_computed_tokens = num_hit
    return hits, num_hit


def finish_step(req: Request, num_tokens: int) -> None:
    req.num_computed_tokens += num_tokens


def test_null_block_reserved_and_usage():
    pool = BlockPool(5)
    assert pool.free_queue.block_ids() == [1, 2, 3, 4]
    assert pool.usage() == 0.0
    blocks = pool.get_new_blocks(2)
    assert [b.block_id for b in blocks] == [1, 2]
    assert pool.usage() == pytest.approx(0.5)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)


def test_allocate_exact_block_ids_and_free_tail_first():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    req = make_request("a", list(range(10)))  # 10 tokens -> 3 blocks
    admit(kv, req)
    assert kv.get_block_ids("a") == [1, 2, 3]
    assert [b.ref_cnt for b in kv.req_to_blocks["a"]] == [1, 1, 1]
    finish_step(req, 10)
    kv.free(req)
    # Blocks 1,2 are full and cached (kept longest, appended tail first: 2 then 1); block 3 is partial,
    # unhashed, so it goes to the head to be reused first.
    assert kv.pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    assert kv.usage == 0.0


def test_prefix_hit_shares_blocks_and_counts_tokens():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(10)))
    admit(kv, a)
    finish_step(a, 10)
    b = make_request("b", list(range(8)) + [99, 98, 97])  # shares the first two full blocks
    hits, num_hit = admit(kv, b)
    assert [h.block_id for h in hits] == [1, 2] and num_hit == 8
    assert kv.get_block_ids("b")[:2] == [1, 2]
    assert kv.get_block_ids("b")[2] == 4
    assert [blk.ref_cnt for blk in kv.req_to_blocks["b"]] == [2, 2, 1]
    assert kv.prefix_cache_queries == 10 + 11 and kv.prefix_cache_hits == 8


def test_full_prompt_hit_recomputes_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    finish_step(a, 8)
    b = make_request("b", list(range(8)))
    hits, num_hit = kv.get_computed_blocks(b)
    # 8 tokens = 2 full blocks, but the hit is capped at 7 tokens -> only 1 block.
    assert [h.block_id for h in hits] == [1] and num_hit == 4


def test_hit_on_free_block_takes_it_out_of_queue_and_lazy_eviction():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    finish_step(a, 9)
    kv.free(a)
    assert kv.pool.free_queue.block_ids() == [3, 4, 5, 2, 1]
    # Cached blocks stay in the hash map while free.
    assert len(kv.pool.cached_blocks) == 2
    b = make_request("b", list(range(8)) + [50])
    hits, _ = admit(kv, b, num_new=1)
    assert [h.block_id for h in hits] == [1, 2]
    assert kv.pool.free_queue.block_ids() == [4, 5]  # 1,2 hit; 3 reused for b's new block
    # A new unrelated request that needs all free blocks evicts nothing cached in use.
    c = make_request("c", [7] * 8)
    admit(kv, c)
    assert kv.get_block_ids("c") == [4, 5]


def test_eviction_pops_lru_and_drops_hash():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    finish_step(a, 8)
    kv.free(a)
    assert kv.pool.free_queue.block_ids() == [3, 2, 1]
    c = make_request("c", [9] * 8)  # takes 3 then 2 (the tail-most cached block is evicted first)
    admit(kv, c)
    assert kv.get_block_ids("c") == [3, 2]
    assert [b.block_id for b in kv.pool.cached_blocks.values()] == [1] + [
        b.block_id for b in kv.req_to_blocks["c"] if b.block_hash
    ]


def test_allocate_returns_none_without_side_effects():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(12)))
    admit(kv, a)
    b = make_request("b", list(range(100, 105)))
    assert kv.allocate_slots(b, 5) is None
    assert kv.get_block_ids("b") == [] and kv.num_free_blocks == 0


def test_collision_guard_checks_tokens():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    finish_step(a, 8)
    # Forge a collision: map b's first block hash to a's block whose tokens differ.
    b = make_request("b", [40, 41, 42, 43, 44])
    kv._update_block_hashes(b)
    kv.pool.cached_blocks[b.block_hashes[0]] = kv.req_to_blocks["a"][0]
    hits, num_hit = kv.get_computed_blocks(b)
    assert hits == [] and num_hit == 0


def test_two_holders_never_share_a_block_they_write():
    """The only blocks two requests hold are full prefix-cache hits: a decode never writes a shared block
    (no copy-on-write exists), whatever the prompt's alignment."""
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a, b = make_request("a", list(range(6))), make_request("b", list(range(6)))  # 1 full + 1 partial block
    admit(kv, a)
    admit(kv, b)  # same step: hits a's full block 1, cached ahead of the step
    assert kv.get_block_ids("a") == [1, 2] and kv.get_block_ids("b") == [1, 3]
    assert [blk.ref_cnt for blk in kv.req_to_blocks["a"]] == [2, 1]
    finish_step(a, 6)
    finish_step(b, 2)
    for r in (a, b):
        r.append_token(100)
        assert kv.allocate_slots(r, 1) == []  # writes position 6 into its own partial block
    assert kv.get_block_ids("a") == [1, 2] and kv.get_block_ids("b") == [1, 3]
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 9


def test_failed_step_uncaches_blocks_a_same_step_hit_holds():
    """a caches its prompt blocks ahead of the step, b hits them in the same step, the step fails and both
    are freed (in either order): nobody wrote those blocks, so they leave the prefix cache."""
    for order in ("ab", "ba"):
        kv = KVCacheManager(num_blocks=10, block_size=BS)
        reqs = {"a": make_request("a", list(range(9))), "b": make_request("b", list(range(9)))}
        admit(kv, reqs["a"])
        _, num_hit = admit(kv, reqs["b"])
        assert num_hit == 8 and [blk.ref_cnt for blk in kv.req_to_blocks["a"][:2]] == [2, 2]
        for rid in order:
            kv.free(reqs[rid])
        assert kv.pool.cached_blocks == {}, order
        assert kv.get_computed_blocks(make_request("c", list(range(9)))) == ([], 0)
        assert kv.num_free_blocks == 9


def test_preempted_before_compute_uncaches_blocks_cached_ahead():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(8)))
    admit(kv, a)  # blocks 1,2 cached ahead of the step
    assert len(kv.pool.cached_blocks) == 2
    kv.free(a)  # preempted before its step ran: num_computed_tokens is still 0
    assert len(kv.pool.cached_blocks) == 0
    b = make_request("b", list(range(8)))
    assert kv.get_computed_blocks(b) == ([], 0)


def test_caching_disabled():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    finish_step(a, 8)
    kv.free(a)
    b = make_request("b", list(range(8)))
    assert kv.get_computed_blocks(b) == ([], 0)
    assert kv.prefix_cache_queries == 0

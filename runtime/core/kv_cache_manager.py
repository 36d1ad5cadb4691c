"""Per-request block tables over the BlockPool, with automatic prefix caching. Pure Python (no torch).

Scheduler-facing verbs (vLLM V1 style): get_computed_blocks (prefix hit), allocate_slots (blocks or None,
None meaning "preempt someone and retry"), free. One sequence per request: a request for n > 1 samples
reaches it as n requests (engine/parent_request.py) that share the prompt's full blocks as prefix-cache
hits, so a block two requests hold is always a full, already-written one and nothing is ever copied on write.

KV cache groups (sliding-window models, see runtime/capacity/kv.py kv_cache_groups): a request has one block
table per group, all drawing from one BlockPool (a block id buys the same bytes in every group). Group 0
is a full-attention group (`req_to_blocks`, `get_block_ids`: what single-group models have); a sliding
group's table holds the null block where its blocks fell out of the window and were freed
(core/sliding_window.py). Prefix-cache entries are per group (the group id is part of the key), and a hit
is the longest length every group can serve. Swapping to host is off for multi-group models (the
scheduler then recomputes: can_swap_out is False).

Host RAM: one pool of host blocks (core/host_pool.py) serves swap preemption or, with `host_tier` on
(--kv-offloading-size), the host KV tier whose scheduler half is core/tier_connector.py (single-group
models with prefix caching only). With the tier on, a swap preemption goes through the tier instead
(can_swap_out): the swap space only adds to the tier's room.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.runtime.core import kv_cache_events as kv_events
from kvserve.runtime.core import sliding_window
from kvserve.runtime.core.block_hash import extend_block_hashes, root_hash
from kvserve.runtime.core.block_pool import BlockPool, KVCacheBlock
from kvserve.runtime.core.disk_index import DiskIndex
from kvserve.runtime.core.host_pool import HostBlockPool
from kvserve.runtime.core.outputs import KVConnectorStep
from kvserve.runtime.core.tier_connector import HostTierConnector
from kvserve.runtime.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PrefixHit(list):
    """get_computed_blocks' result: group 0's hit blocks (the list itself, as for single-group models) and,
    in `groups`, every group's hit table (null blocks before a sliding window)."""

    def __init__(self, blocks=(), groups: list[list[KVCacheBlock]] | None = None):
        super().__init__(blocks)
        self.groups = groups if groups is not None else [list(blocks)]


class KVCacheManager:
    # allocate_slots' shortcut for a single-group running request that needs no new block (most decode
    # steps); off only in the test that checks it against the general path.
    decode_fast_path = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_host_blocks: int = 0,
        group_windows: tuple[int, ...] = (),
        host_tier: bool = False,
        disk_index: DiskIndex | None = None,
    ):
        """group_windows: sliding window per KV cache group (0 = full attention; group 0 must be full);
        empty = one full-attention group. host_tier: keep evicted prefix blocks in the host pool too."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.group_windows = tuple(group_windows) or (0,)
        if self.group_windows[0]:
            raise ValueError(f"KV cache group 0 must be full attention, got windows {self.group_windows}")
        # Per group: request -> block table, and the number of its leading blocks registered in the cache.
        self._tables: list[dict[str, list[KVCacheBlock]]] = [{} for _ in self.group_windows]
        self._num_cached: list[dict[str, int]] = [{} for _ in self.group_windows]
        self.req_to_blocks = self._tables[0]
        self.num_cached_blocks = self._num_cached[0]
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        # Host (CPU RAM) swap space for preemption by swapping: plain block ids into the runner's host tensor.
        self.num_host_blocks = num_host_blocks
        if host_tier and (len(self.group_windows) > 1 or not enable_caching):
            raise ValueError("the host KV tier needs prefix caching and one KV cache group (full attention)")
        self.host = HostBlockPool(num_host_blocks, tier_enabled=host_tier)
        self.host.event_source = self.pool
        self.tier = HostTierConnector(self.host, self.pool, block_size, disk_index) if self.host.tier_enabled else None
        if disk_index is not None:
            disk_index.event_source = self.pool
        self.req_to_host_blocks: dict[str, list[int]] = {}
        self._pending_swap_out: list[tuple[int, int]] = []  # (device block, host block)
        self._pending_swap_in: list[tuple[int, int]] = []  # (host block, device block)
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    # -- queries ---------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage()

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The block tables of groups 1.. (empty for single-group models); 0 = the null block."""
        return tuple([b.block_id for b in table.get(request_id, ())] for table in self._tables[1:])

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks that every group can serve. Capped at num_tokens - 1: the
        last token is always recomputed because its logits are needed."""
        if not self.enable_caching:
            return PrefixHit(), 0
        self._update_block_hashes(request)
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs

        def lookup(group: int, i: int) -> KVCacheBlock | None:
            return self.pool.get_cached_block(
                _group_key(request.block_hashes[i], group), tuple(request.all_token_ids[i * bs : (i + 1) * bs])
            )

        length = max_blocks
        changed = True
        while changed:  # each group's longest hit within the current bound, until all agree
            changed = False
            for g, window in enumerate(self.group_windows):
                n = sliding_window.longest_hit(lambda i, g=g: lookup(g, i) is not None, length, window, bs)
                if n < length:
                    length, changed = n, True
        groups = []
        for g, window in enumerate(self.group_windows):
            skipped = sliding_window.num_skipped_blocks(length * bs, window, bs)
            groups.append([self.pool.null_block] * skipped + [lookup(g, i) for i in range(skipped, length)])
        return PrefixHit(groups[0], groups), length * bs

    # -- allocation ------------------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        defer_caching: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the request's computed ones (plus the prefix
        hit `new_computed_blocks` on admission). Blocks that fell out of a sliding window are freed first.
        Returns group 0's newly allocated blocks, or None when the pool cannot supply them (nothing is
        allocated then). defer_caching: the new blocks' KV arrives later than this step (a P/D pull), so they
        enter the prefix cache only with the request's next allocation."""
        bs, rid = self.block_size, request.request_id
        if self.decode_fast_path and not new_computed_blocks and self.num_groups == 1:
            blocks = self.req_to_blocks.get(rid)
            if blocks is not None:  # a running request (a decode, usually): often nothing to allocate
                num_total = request.num_computed_tokens + num_new_tokens
                if cdiv(num_total, bs) <= len(blocks):
                    # What the general path below does in this case, without its per-group bookkeeping:
                    # no hits, no new block; only a block that fills up this step gets cached.
                    num_full = min(num_total, request.num_tokens)
                    if self.enable_caching and num_full // bs > self.num_cached_blocks.get(rid, 0):
                        self._cache_full_blocks(request, num_full)
                    return []
        hit_groups = list(getattr(new_computed_blocks, "groups", None) or [list(new_computed_blocks)])
        hit_groups += [[] for _ in range(self.num_groups - len(hit_groups))]
        num_hit_tokens = len(new_computed_blocks) * bs
        num_computed = request.num_computed_tokens + num_hit_tokens
        num_total = num_computed + num_new_tokens
        if rid in self.req_to_blocks:
            self._free_skipped_blocks(rid, num_computed)
        needed = 0
        for g, table in enumerate(self._tables):
            blocks, hits = table.get(rid, []), hit_groups[g]
            needed += max(0, cdiv(num_total, bs) - len(blocks) - len(hits))
            # Hit blocks nobody references sit in the free queue: taking them uses up free capacity.
            needed += sum(1 for b in hits if b.ref_cnt == 0 and b is not self.pool.null_block)
        if needed > self.pool.num_free_blocks:
            return None

        new_request = rid not in self.req_to_blocks
        if new_request and self.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens
        # Take every group's hits before allocating anything: a free hit block must not be popped as new.
        for g, table in enumerate(self._tables):
            self.pool.touch(b for b in hit_groups[g] if b is not self.pool.null_block)
            table.setdefault(rid, []).extend(hit_groups[g])
        result: list[KVCacheBlock] = []
        for g, table in enumerate(self._tables):
            blocks = table[rid]
            new_blocks = self.pool.get_new_blocks(max(0, cdiv(num_total, bs) - len(blocks)))
            blocks.extend(new_blocks)
            if g == 0:
                result = new_blocks
        if self.enable_caching and not defer_caching:
            # Cache now the blocks that will be full after this step, so later requests in the same
            # step can share them (their KV is written before any attention of that layer reads it).
            self._cache_full_blocks(request, min(num_total, request.num_tokens))
        return result

    def _free_skipped_blocks(self, rid: str, num_computed_tokens: int) -> None:
        """Swap the blocks no future query of a sliding group reads for the null block and free them,
        newest first back to the first one already freed (so each call costs only what it frees). They keep
        their hashes: a later request with the same prefix can still hit them until they are reused."""
        for g, window in enumerate(self.group_windows):
            if not window:
                continue
            blocks = self._tables[g][rid]
            freed = []
            for i in range(
                min(len(blocks), sliding_window.num_skipped_blocks(num_computed_tokens, window, self.block_size)) - 1,
                -1,
                -1,
            ):
                if blocks[i] is self.pool.null_block:
                    break
                freed.append(blocks[i])
                blocks[i] = self.pool.null_block
            self.pool.free_blocks(freed)

    # -- swap to host ----------------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        if self.num_groups > 1:  # host copies of per-group tables are not implemented: recompute instead
            return False
        if self.tier is not None:
            # One mechanism (issue 41): the victim's full blocks are in the host tier already (saved on store),
            # so it is freed and comes back as a device prefix hit plus tier loads, recomputing only its last
            # partial block. A swap would copy out every block again -- the shared prompt's too, which
            # swap_in then holds as private copies, costing the device pool what the prefix cache shares.
            return False
        return len(self.req_to_blocks.get(request.request_id, ())) <= self.host.num_allocatable

    def swap_out(self, request: Request) -> None:
        """Copy the request's blocks to host memory (the runner does it before this step's forward, so
        the device blocks can be reused in the same step) and free the device blocks."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        host = self.host.allocate(len(blocks))
        self._pending_swap_out += [(b.block_id, h) for b, h in zip(blocks, host)]
        self.req_to_host_blocks[request.request_id] = host
        self.num_swapped_out_blocks += len(host)
        self.free(request, keep_host_blocks=True)

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        num_host = len(self.req_to_host_blocks.get(request.request_id, ()))
        num_needed = max(num_host, cdiv(request.num_computed_tokens + num_new_tokens, self.block_size))
        return num_needed <= self.pool.num_free_blocks

    def swap_in(self, request: Request) -> None:
        host = self.req_to_host_blocks.pop(request.request_id)
        blocks = self.pool.get_new_blocks(len(host))
        self._pending_swap_in += [(h, b.block_id) for h, b in zip(host, blocks)]
        self.host.release(host)
        self.num_swapped_in_blocks += len(host)
        self.req_to_blocks[request.request_id] = blocks
        self.num_cached_blocks[request.request_id] = 0
        if self.enable_caching:  # the copies land before this step's forward: register them again
            self._cache_full_blocks(request, request.num_computed_tokens)

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        swaps = (self._pending_swap_out, self._pending_swap_in)
        self._pending_swap_out, self._pending_swap_in = [], []
        return swaps

    @property
    def num_free_host_blocks(self) -> int:
        """Host blocks no swapped request holds (the tier's entries are a cache: they count as free)."""
        return self.host.num_free_blocks + self.host.num_tier_blocks

    # -- the host KV tier (core/tier_connector.py) -------------------------------------------------------
    def match_offloaded(self, request: Request, num_device_blocks: int) -> int | None:
        """Full blocks after a device hit of num_device_blocks that the host tier can load (0: tier off);
        then either load_offloaded (admitted) or unmatch_offloaded (not). None: the disk tier is fetching
        more of this prefix, schedule the request in a later step."""
        if self.tier is None:
            return 0
        self._update_block_hashes(request)
        return self.tier.match(request, num_device_blocks)

    def load_offloaded(self, request: Request, first: int) -> None:
        """After allocate_slots covered them: the matched blocks, from blocks[first], load from the tier."""
        self.tier.record_load(request, self.req_to_blocks[request.request_id], first)

    def unmatch_offloaded(self, request: Request) -> None:
        if self.tier is not None:
            self.tier.unmatch(request)

    def offload_stats(self, block_bytes: int) -> dict[str, int]:
        """EngineStats' kv_offload_* fields (none while the tier is off)."""
        host = self.host
        if self.tier is None:
            return {}
        return dict(
            kv_offload_capacity_blocks=host.num_blocks,
            kv_offload_used_blocks=host.num_tier_blocks,
            kv_offload_lookup_blocks=host.num_lookup_blocks,
            kv_offload_hit_blocks=host.num_hit_blocks,
            kv_offload_loaded_blocks=host.num_loaded_blocks,
            kv_offload_saved_blocks=host.num_saved_blocks,
            kv_offload_evicted_blocks=host.num_evicted_blocks,
            kv_offload_block_bytes=block_bytes,
            **(self.tier.disk.stats() if self.tier.disk is not None else {}),
        )

    def take_connector_step(self) -> KVConnectorStep:
        return KVConnectorStep() if self.tier is None else self.tier.take_step()

    def connector_step_done(
        self, step: KVConnectorStep, finished_sending, finished_receiving, failed_receiving
    ) -> None:
        if self.tier is not None:
            self.tier.step_done(step, finished_sending, finished_receiving, failed_receiving)

    def abort_connector_steps(self) -> None:
        if self.tier is not None:
            self.tier.abort_outstanding()

    def free(self, request: Request, keep_host_blocks: bool = False) -> None:
        """Release a finished or preempted request's blocks, tail first (longest prefixes are the least
        reusable, so they are evicted first). Blocks cached ahead of their computation (the request is
        finished before its step ran, e.g. that step failed) lose their hash: their KV was never written --
        also when another request took them as a hit in the same step (it was admitted into that step, so
        it fails with it: nobody computed them)."""
        if not keep_host_blocks:
            self.host.release(self.req_to_host_blocks.pop(request.request_id, []))
        null = self.pool.null_block
        for table, num_cached in zip(self._tables, self._num_cached):
            blocks = table.pop(request.request_id, [])  # a sliding table's index i still covers block i
            num_cached.pop(request.request_id, None)
            for block in blocks[request.num_computed_tokens // self.block_size :]:
                if block is not null:
                    self.pool.uncache_block(block)
            self.pool.free_blocks(b for b in reversed(blocks) if b is not null)

    def take_blocks(self, request: Request) -> list[KVCacheBlock]:
        """Group 0's blocks leave the request without being freed (P/D: a lease, or a pull still writing
        them); the holder frees them later with pool.free_blocks. Single-group models only."""
        self.host.release(self.req_to_host_blocks.pop(request.request_id, []))
        self.num_cached_blocks.pop(request.request_id, None)
        return self.req_to_blocks.pop(request.request_id, [])

    # -- hashing ---------------------------------------------------------------------------------------
    def _update_block_hashes(self, request: Request) -> None:
        extend_block_hashes(
            request.block_hashes, request.all_token_ids, self.block_size, root_hash(request.lora_identity)
        )

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        bs, rid = self.block_size, request.request_id
        end = num_tokens // bs
        self._update_block_hashes(request)
        for g, (table, num_cached) in enumerate(zip(self._tables, self._num_cached)):
            start = num_cached.get(rid, 0)
            if end <= start:
                continue
            blocks = table[rid]
            for i in range(start, end):
                if blocks[i] is not self.pool.null_block:  # out of the window: cached before it was freed
                    self.pool.cache_block(
                        blocks[i],
                        _group_key(request.block_hashes[i], g),
                        tuple(request.all_token_ids[i * bs : (i + 1) * bs]),
                    )
            if g == 0 and self.pool.events is not None:
                kv_events.record_stored(self.pool, request, blocks, start, end, bs)
            if g == 0 and self.tier is not None:
                self.tier.record_saves(request, blocks, start, end)
            num_cached[rid] = end


def _group_key(block_hash: bytes, group: int) -> bytes:
    """Prefix-cache key of a block in a group: each group caches and evicts its own blocks (group 0's key is
    the plain chained hash, which the router computes too)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")

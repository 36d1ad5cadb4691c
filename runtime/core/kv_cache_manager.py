"""Per-request block tables over the BlockPool, with automatic prefix caching. Pure Python (no torch).

Scheduler-facing verbs (vLLM V1 style): get_computed_blocks (prefix hit), allocate_slots (blocks or None,
None meaning "preempt someone and retry"), free; plus fork / take_block_copies for n > 1 sampling.
"""
from __future__ import annotations

from collections.abc import Sequence

from kvserve.runtime.core.block_hash import extend_block_hashes
from kvserve.runtime.core.block_pool import BlockPool, KVCacheBlock
from kvserve.runtime.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, num_host_blocks: int = 0):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Number of a request's leading blocks already registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        # Host (CPU RAM) swap space for preemption by swapping: plain block ids into the runner's host tensor.
        self.num_host_blocks = num_host_blocks
        self.free_host_blocks: list[int] = list(range(num_host_blocks - 1, -1, -1))
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

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks. Capped at num_tokens - 1: the last token is always
        recomputed because its logits are needed."""
        if not self.enable_caching:
            return [], 0
        self._update_block_hashes(request)
        bs = self.block_size
        hits: list[KVCacheBlock] = []
        for i in range((request.num_tokens - 1) // bs):
            block = self.pool.get_cached_block(request.block_hashes[i],
                                               tuple(request.all_token_ids[i * bs:(i + 1) * bs]))
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * bs

    # -- allocation ------------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = ()) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the request's computed ones (plus the prefix
        hit `new_computed_blocks` on admission). Returns the newly allocated blocks, or None when the
        pool cannot supply them (nothing is changed then)."""
        bs = self.block_size
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * bs
        num_total = num_computed + num_new_tokens
        num_new_blocks = max(0, cdiv(num_total, bs) - len(blocks) - len(new_computed_blocks))
        # Writing into a partial last block that a forked sibling shares: copy it first.
        needs_copy = (num_new_tokens > 0 and num_computed % bs != 0 and len(blocks) == num_computed // bs + 1
                      and blocks[-1].ref_cnt > 1)
        # Hit blocks nobody references sit in the free queue: taking them uses up free capacity.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + needs_copy + num_free_hits > self.pool.num_free_blocks:
            return None

        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
        if request.request_id not in self.req_to_blocks:
            self.req_to_blocks[request.request_id] = blocks
            if self.enable_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(new_computed_blocks) * bs
        blocks.extend(new_computed_blocks)
        if needs_copy:
            shared = blocks[-1]
            (private,) = self.pool.get_new_blocks(1)
            self._pending_copies.append((shared.block_id, private.block_id))
            blocks[-1] = private
            self.pool.free_blocks([shared])
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        if self.enable_caching:
            # Cache now the blocks that will be full after this step, so later requests in the same
            # step can share them (their KV is written before any attention of that layer reads it).
            self._cache_full_blocks(request, min(num_total, request.num_tokens))
        return new_blocks

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` the parent's block table, sharing every block (ref counts go up)."""
        blocks = self.req_to_blocks[parent.request_id]
        self.pool.touch(blocks)
        self.req_to_blocks[child.request_id] = list(blocks)
        num_prompt_blocks = child.num_prompt_tokens // self.block_size
        child.block_hashes = parent.block_hashes[:num_prompt_blocks]
        self.num_cached_blocks[child.request_id] = min(self.num_cached_blocks.get(parent.request_id, 0),
                                                       num_prompt_blocks)

    # -- swap to host ----------------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        return len(self.req_to_blocks.get(request.request_id, ())) <= len(self.free_host_blocks)

    def swap_out(self, request: Request) -> None:
        """Copy the request's blocks to host memory (the runner does it before this step's forward, so
        the device blocks can be reused in the same step) and free the device blocks."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        host = [self.free_host_blocks.pop() for _ in blocks]
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
        self.free_host_blocks += host
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
        return len(self.free_host_blocks)

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def free(self, request: Request, keep_host_blocks: bool = False) -> None:
        """Release a finished or preempted request's blocks, tail first (longest prefixes are the least
        reusable, so they are evicted first). Blocks cached ahead of their computation (the request is
        preempted before its step ran) lose their hash: their KV was never written."""
        if not keep_host_blocks:
            self.free_host_blocks += self.req_to_host_blocks.pop(request.request_id, [])
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        for block in blocks[request.num_computed_tokens // self.block_size:]:
            if block.ref_cnt == 1:
                self.pool.uncache_block(block)
        self.pool.free_blocks(reversed(blocks))

    # -- hashing ---------------------------------------------------------------------------------------
    def _update_block_hashes(self, request: Request) -> None:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        bs, rid = self.block_size, request.request_id
        start, end = self.num_cached_blocks.get(rid, 0), num_tokens // bs
        if end <= start:
            return
        self._update_block_hashes(request)
        blocks = self.req_to_blocks[rid]
        for i in range(start, end):
            self.pool.cache_block(blocks[i], request.block_hashes[i],
                                  tuple(request.all_token_ids[i * bs:(i + 1) * bs]))
        self.num_cached_blocks[rid] = end

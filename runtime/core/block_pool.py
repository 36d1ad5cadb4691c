"""Physical KV blocks: ref counts, an O(1) LRU free queue, and the prefix-cache hash map. Pure Python.

Eviction order lives in the free queue: allocation pops the head; freed blocks that carry a hash go to the
tail (kept longest), freed blocks without one go to the head (reused first). A cached block keeps its
hash while free and is evicted lazily, only when it is popped for reuse (vLLM V1 BlockPool).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvserve.runtime.core.kv_cache_events import KVEventCollector


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev_free", "next_free", "event_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        # The block's tokens, kept with the hash so a lookup can verify a hit (collision guard).
        self.token_ids: tuple[int, ...] | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.event_hash: int | None = None  # announced as stored in a KV event (core/kv_cache_events.py)

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list over the blocks' own prev/next pointers, with sentinels: O(1) pop, push and
    removal from the middle (a prefix-cache hit on a free block)."""

    def __init__(self, blocks: Iterable[KVCacheBlock]):
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        block.prev_free, block.next_free = prev, prev.next_free
        prev.next_free.prev_free = block
        prev.next_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        ids, node = [], self._head.next_free
        while node is not self._tail:
            ids.append(node.block_id)
            node = node.next_free
        return ids

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    """All blocks, preallocated. Block 0 is the null block: block tables are padded with it, it is never
    handed out, and it is not counted in usage."""

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}
        self.events: KVEventCollector | None = None  # --kv-events-config: what entered and left the cache

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        """Fraction of usable blocks held by requests; cached-but-unreferenced blocks count as free."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} free blocks from the pool ({self.num_free_blocks} free)")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (pulling free ones out of the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks_in_eviction_order: Iterable[KVCacheBlock]) -> None:
        for block in blocks_in_eviction_order:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, block
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def get_cached_block(self, block_hash: bytes, token_ids: tuple[int, ...]) -> KVCacheBlock | None:
        block = self.cached_blocks.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def cache_block(self, block: KVCacheBlock, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        """Register a full block. An identical block already cached keeps the map entry: block tables are
        append-only, so the duplicate simply stays private to its request."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash, block.token_ids = block_hash, token_ids
        self.cached_blocks.setdefault(block_hash, block)

    def uncache_block(self, block: KVCacheBlock) -> None:
        self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache): only while no request holds a block, else
        False and nothing changes."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in list(self.cached_blocks.values()):
            block.event_hash = None  # one AllBlocksCleared below instead of a removal per block
            self._evict(block)
        if self.events is not None:
            self.events.cleared()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
        if block.event_hash is not None:
            if self.events is not None:
                self.events.removed(block.event_hash)
            block.event_hash = None
        block.block_hash = block.token_ids = None

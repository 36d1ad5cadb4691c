"""Approximate prefix-cache index: per replica, a bounded LRU of the block hashes the router sent there.

"Approximate" because it learns from the router's own decisions, not from the engine's cache events: it
guesses what each replica still caches. Bounding each replica's LRU by that replica's KV capacity (in blocks)
keeps the guess honest -- an index larger than the cache would report prefixes the engine already evicted --
and keeps the router's memory bounded (production-stack's unbounded trie grew past 16 GiB, their #687).
Pure Python, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class ReplicaLRU:
    """Block hashes one replica is believed to hold, least recently used first."""

    def __init__(self, capacity_blocks: int):
        self.capacity_blocks = max(1, int(capacity_blocks))
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._hashes

    def matched_blocks(self, hashes: Sequence[bytes]) -> int:
        """Length of the longest prefix of `hashes` held here. The hashes are chained, so the walk stops at the
        first miss: a later block cannot be cached usefully without every block before it."""
        n = 0
        for h in hashes:
            if h not in self._hashes:
                break
            n += 1
        return n

    def record(self, hashes: Sequence[bytes]) -> None:
        """Mark `hashes` (a prompt's chain) as most recently used. Recorded tail first, so the first block ends
        up most recent and, as in the engine, a prompt's later blocks are evicted before its earlier (more
        shared) ones. A prompt longer than the whole LRU keeps its leading blocks."""
        for h in reversed(hashes[: self.capacity_blocks]):
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity_blocks:
            self._hashes.popitem(last=False)

    def resize(self, capacity_blocks: int) -> None:
        self.capacity_blocks = max(1, int(capacity_blocks))
        while len(self._hashes) > self.capacity_blocks:
            self._hashes.popitem(last=False)


class PrefixIndex:
    """One ReplicaLRU per replica key (its URL)."""

    def __init__(self) -> None:
        self._replicas: dict[str, ReplicaLRU] = {}

    def ensure(self, replica: str, capacity_blocks: int) -> ReplicaLRU:
        lru = self._replicas.get(replica)
        if lru is None:
            lru = self._replicas[replica] = ReplicaLRU(capacity_blocks)
        elif lru.capacity_blocks != max(1, int(capacity_blocks)):
            lru.resize(capacity_blocks)
        return lru

    def matched_blocks(self, replica: str, hashes: Sequence[bytes]) -> int:
        lru = self._replicas.get(replica)
        return lru.matched_blocks(hashes) if lru is not None else 0

    def record(self, replica: str, hashes: Sequence[bytes], capacity_blocks: int) -> None:
        self.ensure(replica, capacity_blocks).record(hashes)

    def drop(self, replica: str) -> None:
        """Forget a replica (removed, or ejected: a restarted engine comes back with an empty cache)."""
        self._replicas.pop(replica, None)

    def size(self, replica: str) -> int:
        lru = self._replicas.get(replica)
        return len(lru) if lru is not None else 0

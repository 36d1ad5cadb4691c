"""The local disk KV tier's index, scheduler side (--kv-offloading-disk-dir / --kv-offloading-disk-size):
which blocks the disk holds, by chained block hash, in LRU order, within a size. Pure Python, no torch.

The disk tier sits below the host tier and is staged through it (as vLLM's secondary tiers are): every block
saved to the host tier is also written to disk (by the runner's writer thread, executor/disk_store.py); a
prefix that misses the device and the host but is on disk is first fetched into host slots (one step), then
loaded like any host hit. A block is listed here as soon as its write is handed to the writer: a read of a
file not written yet, or a corrupt one, fails its checksum or is missing, and the request recomputes from
that block on -- the tier never serves a wrong block, it only loses a hit.

Files survive an engine restart: the runner keeps them in a directory named by the KV layout's fingerprint
(model, dtype, block size, layers, heads), and a new engine with the same layout lists them here at start.
"""

from __future__ import annotations

import os
from collections import OrderedDict

BLOCK_FILE_SUFFIX = ".kvblock"


def block_file_name(block_hash: bytes) -> str:
    return block_hash.hex() + BLOCK_FILE_SUFFIX


class DiskIndex:
    def __init__(self, directory: str, capacity_blocks: int):
        if capacity_blocks < 1:
            raise ValueError(f"the disk tier must hold at least one block, got {capacity_blocks}")
        self.directory = directory
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._to_delete: list[bytes] = []
        self.num_restored_blocks = 0
        self.num_hit_blocks = 0
        self.num_written_blocks = 0
        self.num_failed_blocks = 0
        self._restore()

    def _restore(self) -> None:
        """The blocks an earlier engine with this layout left, oldest first (by modification time)."""
        if not os.path.isdir(self.directory):
            return
        found = []
        for name in os.listdir(self.directory):
            if name.endswith(BLOCK_FILE_SUFFIX):
                try:
                    block_hash = bytes.fromhex(name[: -len(BLOCK_FILE_SUFFIX)])
                    found.append((os.path.getmtime(os.path.join(self.directory, name)), block_hash))
                except (ValueError, OSError):
                    continue
        for _, block_hash in sorted(found):
            self.add(block_hash)
        self.num_restored_blocks = len(self._lru)
        self.num_written_blocks = 0

    @property
    def num_blocks(self) -> int:
        return len(self._lru)

    def lookup(self, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._lru

    def touch(self, hashes: list[bytes]) -> None:
        for h in hashes:
            if h in self._lru:
                self._lru.move_to_end(h)

    def add(self, block_hash: bytes) -> None:
        """A block handed to the writer (or found at start); the least recently used ones beyond the
        capacity are listed for deletion."""
        self._lru[block_hash] = None
        self._lru.move_to_end(block_hash)
        self.num_written_blocks += 1
        while len(self._lru) > self.capacity_blocks:
            old, _ = self._lru.popitem(last=False)
            self._to_delete.append(old)

    def discard(self, hashes: list[bytes]) -> None:
        """Blocks whose read failed (missing or corrupt file): forgotten, and their files deleted."""
        for h in hashes:
            if self._lru.pop(h, False) is None:
                self._to_delete.append(h)
        self.num_failed_blocks += len(hashes)

    def take_deletions(self) -> list[bytes]:
        out, self._to_delete = self._to_delete, []
        return out

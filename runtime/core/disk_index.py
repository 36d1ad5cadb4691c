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

from kvserve.runtime.core import kv_cache_events as kv_events

BLOCK_FILE_SUFFIX = ".kvblock"
MEDIUM_DISK = "STORAGE"  # vLLM's medium for its file-system / object tiers (KV events)


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
        # --kv-events-config: the device BlockPool whose collector takes this tier's records (medium STORAGE).
        # Only blocks this engine wrote are announced (a restored block's tokens are unknown here), and so
        # only their removals.
        self.event_source = None
        self._announced: set[bytes] = set()
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

    def add(
        self,
        block_hash: bytes,
        token_ids: list[int] | None = None,
        parent_hash: bytes | None = None,
        lora_name: str | None = None,
    ) -> None:
        """A block handed to the writer (or found at start); the least recently used ones beyond the
        capacity are listed for deletion."""
        self._lru[block_hash] = None
        self._lru.move_to_end(block_hash)
        self.num_written_blocks += 1
        events = self._events()
        if events is not None and token_ids is not None:
            events.stored(
                kv_events.StoredBlocks(
                    block_hashes=[kv_events.external_block_hash(block_hash)],
                    parent_block_hash=kv_events.external_block_hash(parent_hash) if parent_hash else None,
                    token_ids=list(token_ids),
                    block_size=len(token_ids),
                    medium=MEDIUM_DISK,
                    lora_name=lora_name,
                )
            )
            self._announced.add(block_hash)
        while len(self._lru) > self.capacity_blocks:
            old, _ = self._lru.popitem(last=False)
            self._forget(old)

    def discard(self, hashes: list[bytes]) -> None:
        """Blocks whose read failed (missing or corrupt file): forgotten, and their files deleted."""
        for h in hashes:
            if self._lru.pop(h, False) is None:
                self._forget(h)
        self.num_failed_blocks += len(hashes)

    def _forget(self, block_hash: bytes) -> None:
        self._to_delete.append(block_hash)
        events = self._events()
        if block_hash in self._announced:
            self._announced.discard(block_hash)
            if events is not None:
                events.removed(kv_events.external_block_hash(block_hash), medium=MEDIUM_DISK)

    def _events(self) -> kv_events.KVEventCollector | None:
        return None if self.event_source is None else self.event_source.events

    def stats(self) -> dict[str, int]:
        """EngineStats' kv_offload_disk_* fields."""
        return dict(
            kv_offload_disk_capacity_blocks=self.capacity_blocks,
            kv_offload_disk_used_blocks=len(self._lru),
            kv_offload_disk_hit_blocks=self.num_hit_blocks,
            kv_offload_disk_written_blocks=self.num_written_blocks,
            kv_offload_disk_failed_blocks=self.num_failed_blocks,
        )

    def take_deletions(self) -> list[bytes]:
        out, self._to_delete = self._to_delete, []
        return out

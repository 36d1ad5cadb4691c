"""The remote KV tier's scheduler side (--kv-offloading-remote-url): which blocks an existing key-value store
(Redis / Valkey) holds, asked of the store itself, and how it stacks under the disk tier. Pure Python: the
store is reached through a probe the executor layer builds (executor/remote_store.py), so this module does
no I/O of its own.

The remote tier is staged through the host tier like the disk tier (core/tier_connector.py calls the pair of
them `disk`): every block saved to the host tier is also written to the store by the runner's writer thread;
a prefix that misses the device, the host and the disk but is in the store is fetched into host slots (the
request waits one step) and then loaded like any host hit. Unlike the disk tier, the store is shared (other
engines write to it) and evicts on its own (maxmemory-policy allkeys-lru), so there is no local index to
trust: a lookup asks the store (one round trip, EXISTS per block), and a block it lost between the lookup and
the read fails its read and is recomputed -- as does a corrupt value, a timeout or a store that is down.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvserve.runtime.core.disk_index import DiskIndex

# hashes -> for each, whether the store holds it (all False when the store cannot be reached)
Probe = Callable[[list[bytes]], list[bool]]

# How many hashes the index remembers as written to or found in the store (to skip rewriting them): a bound,
# not a capacity -- the store decides what it keeps.
KNOWN_HASHES_BOUND = 1 << 16


class RemoteIndex:
    def __init__(self, probe: Probe):
        self.probe = probe
        self._known: OrderedDict[bytes, None] = OrderedDict()  # written by us or found by a lookup, recently
        self.event_source = None  # no KV events: see docs/kv_offload.md (the store evicts without telling us)
        self.num_lookup_blocks = 0
        self.num_hit_blocks = 0
        self.num_written_blocks = 0
        self.num_failed_blocks = 0

    def __contains__(self, block_hash: bytes) -> bool:
        """Known to be in the store (written by this engine or found by a lookup lately): a save skips it."""
        return block_hash in self._known

    def add(self, block_hash: bytes) -> None:
        """A block handed to the writer thread."""
        self.remember([block_hash])
        self.num_written_blocks += 1

    def unremember(self, hashes: list[bytes]) -> None:
        """Blocks a lookup did not find: the store evicted them (or their write was dropped or failed)."""
        for h in hashes:
            self._known.pop(h, None)

    def forget(self, block_hash: bytes) -> None:
        """Its read failed (missing, corrupt, timed out): the next save writes it again."""
        self._known.pop(block_hash, None)
        self.num_failed_blocks += 1

    def remember(self, hashes: list[bytes]) -> None:
        """Blocks the store holds (written or found)."""
        for h in hashes:
            self._known[h] = None
            self._known.move_to_end(h)
        while len(self._known) > KNOWN_HASHES_BOUND:
            self._known.popitem(last=False)

    def stats(self) -> dict[str, int]:
        """EngineStats' kv_offload_remote_* fields."""
        return dict(
            kv_offload_remote_enabled=1,
            kv_offload_remote_lookup_blocks=self.num_lookup_blocks,
            kv_offload_remote_hit_blocks=self.num_hit_blocks,
            kv_offload_remote_written_blocks=self.num_written_blocks,
            kv_offload_remote_failed_blocks=self.num_failed_blocks,
        )


class LowerTiers:
    """The disk tier (optional) and the remote tier below the host tier, in the shape the host tier's
    connector expects of its `disk` (DiskIndex's methods): a block is available when the disk or the store
    holds it (the disk is asked first, the store only for the rest), written through to both, deleted only from
    the disk. Hits and failures are counted per tier, by where each fetched block was found."""

    def __init__(self, disk: DiskIndex | None, remote: RemoteIndex):
        self.disk = disk
        self.remote = remote
        self.num_hit_blocks = 0  # the connector's total over both tiers (the per-tier counts are below)
        self._found_in: OrderedDict[bytes, str] = OrderedDict()  # hash -> "disk" | "remote", by the last lookup
        self._fetching: OrderedDict[bytes, str] = OrderedDict()  # fetched blocks whose read may still fail

    @property
    def event_source(self):
        return None if self.disk is None else self.disk.event_source

    @event_source.setter
    def event_source(self, pool) -> None:
        if self.disk is not None:  # the disk tier announces its blocks; the store's are not announced
            self.disk.event_source = pool

    def lookup(self, hashes: list[bytes]) -> int:
        """The leading run of `hashes` the disk or the store holds; the store is asked (one round trip) only for
        the blocks past the disk's own leading run that the disk lacks."""
        on_disk = [h in self.disk for h in hashes] if self.disk is not None else [False] * len(hashes)
        first_gap = on_disk.index(False) if False in on_disk else len(hashes)
        rest = [h for h, d in zip(hashes[first_gap:], on_disk[first_gap:]) if not d]
        probed = self.remote.probe(rest) if rest else []
        # A block the store evicted (or never got) must be written again by the next save of it.
        self.remote.unremember([h for h, present in zip(rest, probed) if not present])
        in_store = iter(probed)
        n = 0
        for h, d in zip(hashes, on_disk):
            if d:
                self._note(self._found_in, h, "disk")
            elif next(in_store, False):
                self._note(self._found_in, h, "remote")
            else:
                break
            n += 1
        self.remote.num_lookup_blocks += len(rest)
        self.remote.remember([h for h in hashes[:n] if self._found_in.get(h) == "remote"])
        return n

    def touch(self, hashes: list[bytes]) -> None:
        """The connector fetches these blocks (the lookup's run): count them as hits of the tier that had them,
        until a failed read takes the hit back (discard)."""
        for h in hashes:
            tier = self._found_in.get(h, "disk" if self.disk is not None else "remote")
            self._note(self._fetching, h, tier)
            if tier == "disk":
                self.disk.touch([h])
                self.disk.num_hit_blocks += 1
            else:
                self.remote.num_hit_blocks += 1

    def discard(self, hashes: list[bytes]) -> None:
        """Fetched blocks whose read failed: not a hit after all; the disk deletes its file, the store is left
        to overwrite or evict the value."""
        for h in hashes:
            tier = self._fetching.pop(h, "disk" if self.disk is not None else "remote")
            if tier == "disk":
                self.disk.num_hit_blocks -= 1
                self.disk.discard([h])
            else:
                self.remote.num_hit_blocks -= 1
                self.remote.forget(h)

    def __contains__(self, block_hash: bytes) -> bool:
        """Every lower tier holds it: a save need not write it through."""
        return block_hash in self.remote and (self.disk is None or block_hash in self.disk)

    def add(
        self,
        block_hash: bytes,
        token_ids: list[int] | None = None,
        parent_hash: bytes | None = None,
        lora_name: str | None = None,
    ) -> None:
        """A save written through (the worker writes it to both tiers)."""
        if self.disk is not None and block_hash not in self.disk:
            self.disk.add(block_hash, token_ids, parent_hash, lora_name)
        if block_hash not in self.remote:
            self.remote.add(block_hash)

    def take_deletions(self) -> list[bytes]:
        return self.disk.take_deletions() if self.disk is not None else []

    def stats(self) -> dict[str, int]:
        return {**(self.disk.stats() if self.disk is not None else {}), **self.remote.stats()}

    @staticmethod
    def _note(table: OrderedDict[bytes, str], block_hash: bytes, tier: str) -> None:
        table[block_hash] = tier
        table.move_to_end(block_hash)
        while len(table) > KNOWN_HASHES_BOUND:
            table.popitem(last=False)

"""The exact prefix index, built from the replicas' own KV events (runtime/kv_events/), kvserve's and vLLM's.

Keys. The router cannot reproduce every engine's block hash (vLLM's default is a pickled sha256 with a
per-deployment seed), so it keys blocks by the token ids the events carry, as llm-d's indexer does: a
BlockStored's blocks get the router's own chained keys (core/block_hash.py over the event's token ids, chained
from the parent block's key, seeded per LoRA adapter name as the estimate is: scoring.adapter_root), the
same keys `HashCache` computes for a request. Each replica's engine hash -> key map resolves its later
BlockRemoved events (and tokenless stores of an already known block in another tier, e.g. vLLM's CPU
offload placeholders). A store whose parent the router never saw cannot be chained and is skipped (counted).

Per replica: key -> {medium: copies}. Copies count duplicate stores of one hash (vLLM may cache two blocks
with equal hashes and evicts them one by one); a block is held while any copy is. AllBlocksCleared empties
the replica. The index holds what each replica's stream says and nothing else, so its size is bounded by the
replicas' cache sizes.

Scoring: the longest consecutive prefix of the request's blocks held in any tier, each block weighted by its
best tier (device "GPU" 1.0, host "CPU" 0.8, anything else -- "STORAGE" -- 0.5; a None medium is the device,
as old vLLM sent): a block on the host costs a copy, far less than a recompute, more than a device hit.

Freshness: a replica's index is used only while its stream is synced and its last message (a batch or an
idle heartbeat) is at most `stale_after_s` old; otherwise `PreciseOrEstimate` answers from the router's
estimate (prefix_index.PrefixIndex) for that replica. Pure: no I/O; times are passed in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvserve.runtime.core.block_hash import hash_block_tokens
from kvserve.runtime.kv_events.events import Cleared, DecodedBatch, Removed, Stored
from kvserve.runtime.router.prefix_index import PrefixIndex
from kvserve.runtime.router.scoring import adapter_root

DEVICE_MEDIUM = "GPU"
TIER_WEIGHTS = {"GPU": 1.0, "CPU": 0.8}
OTHER_TIER_WEIGHT = 0.5


def tier_weight(medium: str | None) -> float:
    return TIER_WEIGHTS.get((medium or DEVICE_MEDIUM).upper(), OTHER_TIER_WEIGHT)


@dataclass
class ReplicaBlocks:
    """One replica's blocks as its event stream describes them."""

    blocks: dict[bytes, dict[str, int]] = field(default_factory=dict)  # router key -> {medium: copies}
    engine_keys: dict[int | bytes, bytes] = field(default_factory=dict)  # engine block hash -> router key
    block_size: int | None = None  # from its BlockStored events
    synced: bool = False  # a stream position is known (set by the subscriber)
    partial: bool = False  # history was lost before the last resync: blocks stored earlier are unknown
    last_message_at: float | None = None  # monotonic time of the last batch or heartbeat
    orphan_stores: int = 0  # stores whose parent block was never seen (not indexed)
    resync_requested: bool = False  # the router saw the replica fail (ejected): rebuild at the next message

    def clear(self) -> None:
        self.blocks.clear()
        self.engine_keys.clear()

    def apply(self, batch: DecodedBatch) -> None:
        for event in batch.events:
            if isinstance(event, Stored):
                self._store(event)
            elif isinstance(event, Removed):
                self._remove(event)
            elif isinstance(event, Cleared):
                self.clear()

    def _store(self, e: Stored) -> None:
        medium = (e.medium or DEVICE_MEDIUM).upper()
        bs = e.block_size
        if len(e.token_ids) < len(e.block_hashes) * bs:  # tokenless (offload placeholder): known blocks only
            for h in e.block_hashes:
                key = self.engine_keys.get(h)
                if key is not None:
                    self._add(key, medium)
            return
        if e.parent_block_hash is None:
            parent = adapter_root(e.lora_name)
        else:
            parent = self.engine_keys.get(e.parent_block_hash)
            if parent is None:
                self.orphan_stores += 1
                return
        self.block_size = bs
        for i, h in enumerate(e.block_hashes):
            parent = hash_block_tokens(parent, e.token_ids[i * bs : (i + 1) * bs])
            self.engine_keys[h] = parent
            self._add(parent, medium)

    def _add(self, key: bytes, medium: str) -> None:
        tiers = self.blocks.setdefault(key, {})
        tiers[medium] = tiers.get(medium, 0) + 1

    def _remove(self, e: Removed) -> None:
        medium = (e.medium or DEVICE_MEDIUM).upper()
        for h in e.block_hashes:
            key = self.engine_keys.get(h)
            tiers = self.blocks.get(key) if key is not None else None
            if tiers is None or medium not in tiers:
                continue
            tiers[medium] -= 1
            if tiers[medium] <= 0:
                del tiers[medium]
            if not tiers:
                del self.blocks[key]
                del self.engine_keys[h]

    def matched_blocks(self, hashes: Sequence[bytes]) -> float:
        """Tier-weighted length of the longest prefix of `hashes` held here."""
        total = 0.0
        for h in hashes:
            tiers = self.blocks.get(h)
            if not tiers:
                break
            total += max(tier_weight(m) for m in tiers)
        return total


class KVEventIndex:
    """ReplicaBlocks per replica URL; the subscribers (kv_subscriber.py) feed it."""

    def __init__(self, stale_after_s: float = 5.0):
        self.stale_after_s = stale_after_s  # 0: a synced stream never goes stale (engines without heartbeats)
        self.replicas: dict[str, ReplicaBlocks] = {}

    def replica(self, url: str) -> ReplicaBlocks:
        state = self.replicas.get(url)
        if state is None:
            state = self.replicas[url] = ReplicaBlocks()
        return state

    def forget(self, url: str) -> None:
        self.replicas.pop(url, None)

    def is_fresh(self, url: str, now: float) -> bool:
        state = self.replicas.get(url)
        if state is None or not state.synced or state.last_message_at is None:
            return False
        return self.stale_after_s <= 0 or now - state.last_message_at <= self.stale_after_s

    def matched_blocks(self, url: str, hashes: Sequence[bytes]) -> float:
        state = self.replicas.get(url)
        return state.matched_blocks(hashes) if state is not None else 0.0

    def replicas_holding(self, key: bytes) -> dict[str, set[str]]:
        """Which replicas hold a block key, in which tiers (for inspection and tests)."""
        return {url: set(s.blocks[key]) for url, s in self.replicas.items() if key in s.blocks}


class PreciseOrEstimate:
    """The router's prefix index: a replica with a fresh event stream is scored from its events, any other
    from the estimate of what the router sent it. Records and drops go to the estimate, which stays warm for
    the moment a stream goes stale. Duck-types PrefixIndex (the ReplicaSet's `index`)."""

    def __init__(self, estimate: PrefixIndex, events: KVEventIndex, clock: Callable[[], float] = time.monotonic):
        self.estimate = estimate
        self.events = events
        self.clock = clock

    def uses_events(self, url: str) -> bool:
        return self.events.is_fresh(url, self.clock())

    def matched_blocks(self, url: str, hashes: Sequence[bytes]) -> float:
        if self.uses_events(url):
            return self.events.matched_blocks(url, hashes)
        return self.estimate.matched_blocks(url, hashes)

    def ensure(self, url: str, capacity_blocks: int):
        return self.estimate.ensure(url, capacity_blocks)

    def record(self, url: str, hashes: Sequence[bytes], capacity_blocks: int) -> None:
        self.estimate.record(url, hashes, capacity_blocks)

    def drop(self, url: str) -> None:
        """The replica was ejected (it may have restarted) or removed: besides the estimate, its event index
        is rebuilt from the publisher's replay at the next message. A restart shows in the sequence only when
        the router sees the new publisher's sequence at or below the old one's; this catches the rest."""
        self.estimate.drop(url)
        state = self.events.replicas.get(url)
        if state is not None:
            state.synced, state.resync_requested = False, True

    def size(self, url: str) -> int:
        if self.uses_events(url):
            return len(self.events.replicas[url].blocks)
        return self.estimate.size(url)

"""The host (CPU RAM) KV block pool, scheduler side: one pool of block slots in the runner's host tensor, shared
by swap preemption and the host KV tier (--kv-offloading-size). Pure Python (no torch).

A slot is free, held by a swapped-out request (swap_out: never evicted until swapped in), or a tier entry: a
copy of one full prefix block, keyed by its chained block hash (the LoRA adapter is in the hash's root, as on
the device) and verified by its token ids. A tier entry is

- pending from the step that records its save until that step's output reports the save done (finished_sending):
  invisible to lookups, not evictable (its copy may not have landed yet);
- committed afterwards: found by lookup, in an LRU order (a hit moves it to the back: promotion), evicted from
  the front when a save or a swap needs a slot;
- pinned while a step loads from it (between the schedule that records the load and that step's output), so
  a swap-out in the same step cannot take its slot.

Why one pool with swap: a swapped request's blocks and offloaded prefix blocks are the same bytes in the same
host tensor; a swap simply outranks the cache (it evicts tier entries to fit), and the runner runs one copy
routine for both.
"""

from __future__ import annotations

from collections import OrderedDict

from kvserve.runtime.core import kv_cache_events as kv_events

MEDIUM_HOST = "CPU"  # vLLM's medium for its CPU offload tier (KV events)


class HostBlockPool:
    def __init__(self, num_blocks: int, tier_enabled: bool = False):
        if num_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.tier_enabled = tier_enabled and num_blocks > 0
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # committed tier entries, least recent first
        self._pending: set[bytes] = set()  # hashes whose saves are recorded, not reported done yet
        self._slot_hash: dict[int, bytes] = {}  # every tier entry's slot -> its hash
        self._tokens: dict[int, tuple[int, ...]] = {}  # tier entry's slot -> its token ids (collision guard)
        # tier entry's slot -> (the hash of the block before it, its request's LoRA adapter): for KV events
        self._parents: dict[int, tuple[bytes | None, str | None]] = {}
        self._pinned: dict[int, int] = {}  # slot -> loads in flight
        # --kv-events-config: the device BlockPool whose `events` collector (set by the publisher) also takes
        # this tier's records, with medium CPU, so one step's batch holds both tiers in order.
        self.event_source = None
        # Cumulative counters (Prometheus, per tier "cpu"): blocks found / loaded / saved / evicted.
        self.num_lookup_blocks = 0
        self.num_hit_blocks = 0
        self.num_loaded_blocks = 0
        self.num_saved_blocks = 0
        self.num_evicted_blocks = 0

    # -- occupancy -------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Slots free outright (tier entries not counted: they are a cache)."""
        return len(self._free)

    @property
    def num_tier_blocks(self) -> int:
        return len(self._slot_hash)

    @property
    def num_allocatable(self) -> int:
        """Slots a swap-out could get now: free ones and committed, unpinned tier entries."""
        return len(self._free) + sum(1 for s in self._lru.values() if s not in self._pinned)

    # -- swap preemption -------------------------------------------------------------------------------
    def allocate(self, num: int) -> list[int]:
        """Slots for a swapped-out request, evicting the least recently used tier entries as needed."""
        if num > self.num_allocatable:
            raise ValueError(f"cannot get {num} host blocks ({self.num_allocatable} allocatable)")
        return [self._take_slot() for _ in range(num)]

    def release(self, slots: list[int]) -> None:
        self._free += slots

    # -- the tier, scheduler side ----------------------------------------------------------------------
    def lookup(self, hashes: list[bytes], token_ids: list[tuple[int, ...]]) -> int:
        """How many of the leading blocks (hashes[i] with token_ids[i]) the tier holds, committed."""
        n = 0
        for h, tokens in zip(hashes, token_ids):
            slot = self._lru.get(h)
            if slot is None or self._tokens[slot] != tokens:
                break
            n += 1
        self.num_lookup_blocks += len(hashes)
        self.num_hit_blocks += n
        return n

    def contains(self, block_hash: bytes) -> bool:
        """Held in any state (a save of it is pointless)."""
        return block_hash in self._lru or block_hash in self._pending

    def touch(self, hashes: list[bytes]) -> None:
        """Most recently used now (committed entries only)."""
        for h in hashes:
            if h in self._lru:
                self._lru.move_to_end(h)

    def pin_for_load(self, hashes: list[bytes]) -> list[int]:
        """The slots of committed entries a step loads from: pinned until unpin(), promoted in the LRU."""
        slots = []
        for h in hashes:
            slot = self._lru[h]
            self._lru.move_to_end(h)
            self._pinned[slot] = self._pinned.get(slot, 0) + 1
            slots.append(slot)
        return slots

    def unpin(self, slots: list[int]) -> None:
        for slot in slots:
            left = self._pinned[slot] - 1
            if left:
                self._pinned[slot] = left
            else:
                del self._pinned[slot]

    def reserve_for_save(
        self, block_hash: bytes, token_ids: tuple[int, ...], parent_hash: bytes | None, lora_name: str | None = None
    ) -> int | None:
        """A pending entry for a block to save, or None when every slot is taken (swapped requests, pending or
        pinned entries): the block is simply not offloaded."""
        if not self._free and not any(s not in self._pinned for s in self._lru.values()):
            return None
        slot = self._take_slot()
        self._pending.add(block_hash)
        self._slot_hash[slot] = block_hash
        self._tokens[slot] = token_ids
        self._parents[slot] = (parent_hash, lora_name)
        return slot

    def commit(self, slots: list[int]) -> None:
        """Saves reported done: the entries become visible (most recently used), announced in KV events
        with medium CPU."""
        events = self._events()
        for slot in slots:
            h = self._slot_hash[slot]
            self._pending.discard(h)
            self._lru[h] = slot
            if events is not None:
                parent, lora_name = self._parents[slot]
                events.stored(
                    kv_events.StoredBlocks(
                        block_hashes=[kv_events.external_block_hash(h)],
                        parent_block_hash=kv_events.external_block_hash(parent) if parent else None,
                        token_ids=list(self._tokens[slot]),
                        block_size=len(self._tokens[slot]),
                        medium=MEDIUM_HOST,
                        lora_name=lora_name,
                    )
                )
        self.num_saved_blocks += len(slots)

    def abort(self, slots: list[int]) -> None:
        """Saves that never ran (their step failed): the slots go back, nothing was announced."""
        for slot in slots:
            self._pending.discard(self._slot_hash.get(slot))
            self._drop_entry(slot, announce=False)

    # -- internals -------------------------------------------------------------------------------------
    def _events(self) -> kv_events.KVEventCollector | None:
        return None if self.event_source is None else self.event_source.events

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        for h, slot in self._lru.items():  # least recently used first
            if slot not in self._pinned:
                del self._lru[h]
                self._drop_entry(slot, announce=True, keep_slot=True)
                self.num_evicted_blocks += 1
                return slot
        raise ValueError("no host block to take")

    def _drop_entry(self, slot: int, announce: bool, keep_slot: bool = False) -> None:
        h = self._slot_hash.pop(slot, None)
        self._tokens.pop(slot, None)
        self._parents.pop(slot, None)
        events = self._events()
        if announce and h is not None and events is not None:
            events.removed(kv_events.external_block_hash(h), medium=MEDIUM_HOST)
        if not keep_slot:
            self._free.append(slot)

"""What the prefix cache did, as records for `--kv-events-config` (runtime/kv_events/ publishes them in vLLM's
wire format). Pure Python: no torch, no msgspec -- the planner (and so the operator image) imports the core.

The block pool and the KV manager append a record when a full block enters the prefix-cache map (stored),
leaves it (removed: evicted for reuse, or uncached because its KV was never written) or when the whole cache
is reset (cleared). The engine core takes the records once per step (`take`) and publishes them as one batch.
Off (the collector is None) nothing is recorded and nothing is allocated.

Block hashes leave the engine as vLLM's `ExternalBlockHash` int form: the low 64 bits of the chained digest
(core/block_hash.py: BLAKE2b-128 over the parent digest and the block's int64 token ids, seeded by the fixed
NONE_HASH), i.e. its last 8 bytes read big-endian. The chain is a pure function of the token ids, so every
process -- each TP/PP rank, the engine after a restart, any router -- gets the same hashes.
"""

from __future__ import annotations

from dataclasses import dataclass

MEDIUM_DEVICE = "GPU"  # vLLM's MEDIUM_GPU: the engine's device KV pool (also on a CPU-only engine: its one tier)


def external_block_hash(block_hash: bytes) -> int:
    """vLLM's int form of a block hash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, its default)."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(frozen=True)
class StoredBlocks:
    """Consecutive full blocks of one request entered the cache: block_hashes[i] covers
    token_ids[i * block_size : (i + 1) * block_size]; parent_block_hash is the block before the first (None:
    the first is the prompt's first block)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None  # None: the device pool (MEDIUM_DEVICE); "CPU": the host tier (core/host_pool.py)


@dataclass(frozen=True)
class RemovedBlocks:
    block_hashes: list[int]
    medium: str | None = None


@dataclass(frozen=True)
class AllCleared:
    pass


CacheEvent = StoredBlocks | RemovedBlocks | AllCleared


class KVEventCollector:
    """The records of one engine step, in the order they happened. Removals are merged into the previous
    record when it is a removal too (evictions come one block at a time)."""

    __slots__ = ("_events",)

    def __init__(self) -> None:
        self._events: list[CacheEvent] = []

    def stored(self, record: StoredBlocks) -> None:
        self._events.append(record)

    def removed(self, block_hash: int, medium: str | None = None) -> None:
        events = self._events
        if events and isinstance(events[-1], RemovedBlocks) and events[-1].medium == medium:
            events[-1].block_hashes.append(block_hash)
        else:
            events.append(RemovedBlocks([block_hash], medium))

    def cleared(self) -> None:
        self._events.append(AllCleared())

    def take(self) -> list[CacheEvent]:
        events, self._events = self._events, []
        return events

    def __len__(self) -> int:
        return len(self._events)


def record_stored(pool, request, blocks: list, start: int, end: int, block_size: int) -> None:
    """After group 0's blocks[start:end] of `request` were offered to the prefix cache: one StoredBlocks per
    run of blocks that became the cache's entry for their hash (a duplicate of a block already cached stays
    private to its request and is never announced). Marks them, so their eviction is announced too."""
    hashes = request.block_hashes
    run: list[int] = []
    run_start = start
    for i in range(start, end + 1):
        block = blocks[i] if i < end else None
        key = hashes[i] if i < end else None
        if block is not None and block.event_hash is None and pool.cached_blocks.get(key) is block:
            block.event_hash = external_block_hash(key)
            if not run:
                run_start = i
            run.append(block.event_hash)
            continue
        if run:
            pool.events.stored(
                StoredBlocks(
                    block_hashes=run,
                    parent_block_hash=external_block_hash(hashes[run_start - 1]) if run_start else None,
                    token_ids=list(request.all_token_ids[run_start * block_size : (run_start + len(run)) * block_size]),
                    block_size=block_size,
                    lora_name=request.lora_name,
                )
            )
            run = []

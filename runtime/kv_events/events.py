"""vLLM's KV-event types (vllm/distributed/kv_events.py), and a decoder for both of its encodings.

Encoding (what kvserve publishes): vLLM's current form. `KVCacheEvent` structs are tagged maps
(`{"type": "BlockStored", ...}`, msgspec tag=True, omit_defaults=True) and the batch is a map too
(`{"ts": ..., "events": [...], "data_parallel_rank": 0}`) -- as vLLM's source declares it (EventBatch without
array_like; read at vllm-project/vllm commit 0181ea31). Older vLLM (v0.22/v0.23) sent both as positional
arrays: `[ts, [["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, ...], ...], dp_rank]`.

Decoding (what the router reads): either form, batch and events independently, with length guards and
unknown fields ignored (newer vLLM adds fields at the end), so one router reads kvserve and any vLLM.
Block hashes are `ExternalBlockHash = int | bytes`: kvserve sends ints (core/kv_cache_events.py); vLLM sends
ints by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1) and raw 32-byte digests otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvserve.runtime.core.kv_cache_events import AllCleared, CacheEvent, RemovedBlocks, StoredBlocks

ExternalBlockHash = int | bytes


class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events; the tag (field "type") is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # deprecated in vLLM (lora_name keys the hash); kvserve sends None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_wire(records: list[CacheEvent], medium: str) -> list[KVCacheEvent]:
    """The core's records (core/kv_cache_events.py) as vLLM events; `medium` is the tier of records that name
    none (the device pool), a record of another tier (the host tier: "CPU") carries its own."""
    out: list[KVCacheEvent] = []
    for r in records:
        if isinstance(r, StoredBlocks):
            out.append(
                BlockStored(
                    r.block_hashes,
                    r.parent_block_hash,
                    r.token_ids,
                    r.block_size,
                    None,
                    r.medium or medium,
                    r.lora_name,
                )
            )
        elif isinstance(r, RemovedBlocks):
            out.append(BlockRemoved(r.block_hashes, r.medium or medium))
        elif isinstance(r, AllCleared):
            out.append(AllBlocksCleared())
        else:
            raise TypeError(f"not a KV cache event record: {r!r}")
    return out


# ---- decoding, both forms -------------------------------------------------------------------------------------
class MalformedEvent(ValueError):
    """A payload that is neither of vLLM's forms; the subscriber counts it and resyncs."""


@dataclass(frozen=True)
class Stored:
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    medium: str | None
    lora_name: str | None


@dataclass(frozen=True)
class Removed:
    block_hashes: list[ExternalBlockHash]
    medium: str | None


@dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(frozen=True)
class DecodedBatch:
    ts: float
    events: list[Event]
    data_parallel_rank: int | None


_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
_REMOVED_FIELDS = ("block_hashes", "medium")


def decode_batch(payload: bytes) -> DecodedBatch:
    """One message's third frame -> its events. MalformedEvent for anything else."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise MalformedEvent(f"not msgpack: {exc}") from None
    if isinstance(raw, dict):
        ts, events, dp_rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        dp_rank = raw[2] if len(raw) > 2 else None
    else:
        raise MalformedEvent(f"an event batch is a map or an array, got {type(raw).__name__}")
    if not isinstance(ts, (int, float)) or not isinstance(events, list):
        raise MalformedEvent("an event batch needs a numeric ts and a list of events")
    return DecodedBatch(float(ts), [_decode_event(e) for e in events], dp_rank)


def _decode_event(raw: Any) -> Event:
    if isinstance(raw, dict):
        kind, get = raw.get("type"), raw.get
    elif isinstance(raw, list) and raw:
        kind = raw[0]
        names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS if kind == "BlockRemoved" else ()
        values = dict(zip(names, raw[1:]))
        get = values.get
    else:
        raise MalformedEvent(f"an event is a tagged map or array, got {raw!r:.80}")
    if kind == "BlockStored":
        hashes, tokens, block_size = get("block_hashes"), get("token_ids"), get("block_size")
        if not isinstance(hashes, list) or not isinstance(tokens, list) or not isinstance(block_size, int):
            raise MalformedEvent("BlockStored needs block_hashes, token_ids and block_size")
        return Stored(hashes, get("parent_block_hash"), tokens, block_size, get("medium"), get("lora_name"))
    if kind == "BlockRemoved":
        hashes = get("block_hashes")
        if not isinstance(hashes, list):
            raise MalformedEvent("BlockRemoved needs block_hashes")
        return Removed(hashes, get("medium"))
    if kind == "AllBlocksCleared":
        return Cleared()
    raise MalformedEvent(f"unknown event type {kind!r}")

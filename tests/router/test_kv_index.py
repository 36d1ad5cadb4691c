"""The router's exact prefix index from vLLM-format KV events (router/kv_index.py): batches synthesised with plain
msgpack in both of vLLM's encodings (v0.22-style positional arrays, current tagged maps), with vLLM-style engine
hashes (arbitrary 64-bit ints or 32-byte digests: the router keys blocks by the tokens the events carry)."""

from __future__ import annotations

import random

import msgpack
import pytest

from kvserve.runtime.kv_events.events import MalformedEvent, decode_batch
from kvserve.runtime.router.kv_index import KVEventIndex, PreciseOrEstimate
from kvserve.runtime.router.prefix_index import PrefixIndex
from kvserve.runtime.router.scoring import HashCache, ReplicaView, RequestFeatures, Weights, rank

BS = 16
rng = random.Random(7)
PROMPT = [rng.randrange(1, 30000) for _ in range(3 * BS + 5)]  # 3 full blocks and a partial one
H = [rng.getrandbits(64) for _ in range(3)]  # the engine's hashes of those blocks (opaque to the router)


def stored(form: str, hashes, parent, tokens, medium="GPU", lora_name=None):
    if form == "array":  # vLLM <= v0.23: positional, lora_id before medium; lora_name appended later
        return ["BlockStored", hashes, parent, tokens, BS, None, medium, lora_name]
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": medium,
        "lora_name": lora_name,
        "extra_keys": None,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",  # a newer field: ignored
    }


def removed(form: str, hashes, medium="GPU"):
    if form == "array":
        return ["BlockRemoved", hashes, medium]
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def cleared(form: str):
    return ["AllBlocksCleared"] if form == "array" else {"type": "AllBlocksCleared"}


def batch(form: str, *events) -> bytes:
    if form == "array":
        return msgpack.packb([1733300000.5, list(events), 0])
    return msgpack.packb({"ts": 1733300000.5, "events": list(events), "data_parallel_rank": 0})


def make_index(*payloads: bytes, url: str = "r1") -> KVEventIndex:
    index = KVEventIndex()
    state = index.replica(url)
    for p in payloads:
        state.apply(decode_batch(p))
    state.synced, state.last_message_at = True, 0.0
    return index


def request_hashes(tokens=PROMPT, adapter=None):
    return HashCache(tokens, adapter=adapter)(BS)


@pytest.mark.parametrize("form", ["array", "map"])
def test_stored_chains_across_events_and_removal_cuts_the_prefix(form):
    first = batch(form, stored(form, H[:2], None, PROMPT[: 2 * BS]))
    second = batch(form, stored(form, [H[2]], H[1], PROMPT[2 * BS : 3 * BS]))
    index = make_index(first, second)
    assert index.matched_blocks("r1", request_hashes()) == 3
    assert index.matched_blocks("r2", request_hashes()) == 0
    other = PROMPT[:BS] + [1] * (2 * BS)  # shares only the first block
    assert index.matched_blocks("r1", request_hashes(other)) == 1
    key = request_hashes()[2]
    assert index.replicas_holding(key) == {"r1": {"GPU"}}
    index.replica("r1").apply(decode_batch(batch(form, removed(form, [H[1]]))))
    assert index.matched_blocks("r1", request_hashes()) == 1  # block 2 is still held, but not reachable


@pytest.mark.parametrize("form", ["array", "map"])
def test_host_tier_counts_less_and_cleared_empties(form):
    index = make_index(
        batch(form, stored(form, H[:2], None, PROMPT[: 2 * BS])),
        # vLLM's CPU offload: a tokenless placeholder store of known engine hashes, then the GPU copy goes.
        batch(form, stored(form, [H[1]], None, [], medium="CPU"), removed(form, [H[1]], medium="GPU")),
    )
    assert index.matched_blocks("r1", request_hashes()) == pytest.approx(1.0 + 0.8)
    index.replica("r1").apply(decode_batch(batch(form, cleared(form))))
    assert index.matched_blocks("r1", request_hashes()) == 0
    assert not index.replica("r1").engine_keys


def test_duplicate_stores_are_counted_and_bytes_hashes_work():
    digest = [bytes([i]) * 32 for i in range(2)]  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: raw digests
    store = stored("map", digest, None, PROMPT[: 2 * BS])
    index = make_index(batch("map", store, store))
    index.replica("r1").apply(decode_batch(batch("map", removed("map", [digest[1]]))))
    assert index.matched_blocks("r1", request_hashes()) == 2  # one copy of block 2 is left
    index.replica("r1").apply(decode_batch(batch("map", removed("map", [digest[1]]))))
    assert index.matched_blocks("r1", request_hashes()) == 1


def test_orphan_store_is_skipped_and_lora_blocks_match_only_their_adapter():
    index = make_index(
        batch("map", stored("map", [H[2]], 12345, PROMPT[2 * BS : 3 * BS])),  # parent never seen
        batch("map", stored("map", H[:2], None, PROMPT[: 2 * BS], lora_name="sql")),
    )
    assert index.replica("r1").orphan_stores == 1
    assert index.matched_blocks("r1", request_hashes(adapter="sql")) == 2
    assert index.matched_blocks("r1", request_hashes()) == 0  # the base model's chain differs


def test_malformed_payloads_are_rejected():
    for payload in (b"\xc1", msgpack.packb("x"), msgpack.packb({"ts": 1.0, "events": [{"type": "Nope"}]})):
        with pytest.raises(MalformedEvent):
            decode_batch(payload)
    with pytest.raises(MalformedEvent):
        decode_batch(msgpack.packb([1.0, [["BlockStored", [1], None]]]))  # too short to be a store


def test_precise_wins_over_the_estimate_only_while_fresh():
    now = [100.0]
    index = KVEventIndex(stale_after_s=5.0)
    # What the replicas really hold: r2 has the prompt (another router sent it there); r1 evicted it.
    state = index.replica("http://r2")
    state.apply(decode_batch(batch("map", stored("map", H, None, PROMPT[: 3 * BS]))))
    state.synced, state.last_message_at = True, 99.0
    index.replica("http://r1").synced = True
    index.replica("http://r1").last_message_at = 99.0
    estimate = PrefixIndex()
    estimate.record("http://r1", request_hashes(), capacity_blocks=1000)  # this router's stale belief
    combined = PreciseOrEstimate(estimate, index, clock=lambda: now[0])
    views = [ReplicaView("http://r1", block_size=BS), ReplicaView("http://r2", block_size=BS)]
    features = RequestFeatures(hashes_for=HashCache(PROMPT), num_prompt_tokens=len(PROMPT))
    decision = rank(features, views, combined, Weights(), random.Random(0))
    assert decision.urls[0] == "http://r2" and decision.ranked[0].matched_blocks == 3
    now[0] = 110.0  # both streams silent past stale_after_s: back to the estimate
    decision = rank(features, views, combined, Weights(), random.Random(0))
    assert decision.urls[0] == "http://r1"

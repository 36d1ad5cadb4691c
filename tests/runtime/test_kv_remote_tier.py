"""The remote KV tier (--kv-offloading-remote-url) on a real redis-server: values checksummed and written by a
thread, blocks found by a second engine with empty local tiers, a corrupt value or a dead store costs a
recompute, never a wrong token."""

from __future__ import annotations

import time

import pytest
import torch
from kv_offload_testing import BYTES_PER_BLOCK, GIB, conversations, run_rounds
from kvserve_testing import STORIES_DIR
from prometheus_client import generate_latest
from redis_testing import RedisServer

from kvserve.runtime.config import make_engine_config
from kvserve.runtime.core.kv_cache_events import StoredBlocks
from kvserve.runtime.core.remote_index import LowerTiers, RemoteIndex
from kvserve.runtime.errors import InvalidParameter
from kvserve.runtime.executor import remote_store
from kvserve.runtime.executor.remote_store import RemoteStore, StoreLink, make_probe
from kvserve.runtime.metrics import ServerMetrics
from kvserve.runtime.models.synthetic import make_random_adapter_dir

HOST_BLOCKS = 8  # a small host tier: most of the history only the lower tiers keep


@pytest.fixture
def redis_server():
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory("llama_gqa")[0]


def test_value_round_trip_corrupt_missing_hung_and_dead_store(redis_server):
    block = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).view(2, 3, 4, 5)
    store = RemoteStore(redis_server.url, "kvserve:kv:test:", block.numel() * 4)
    h = b"\x01" * 16
    store.write_async(h, block.clone())
    store.flush()
    out = torch.zeros_like(block)
    assert store.read_into(h, out) and torch.equal(out, block)
    assert not store.read_into(b"\x02" * 16, torch.zeros_like(block))  # missing
    probe = make_probe(StoreLink(redis_server.url), "kvserve:kv:test:")
    assert probe([h, b"\x02" * 16]) == [True, False]

    client = redis_server.client()
    key = "kvserve:kv:test:" + h.hex()
    value = bytearray(client.get(key))
    value[-1] ^= 0xFF
    client.set(key, bytes(value))
    assert not store.read_into(h, torch.zeros_like(block))  # digest
    client.set(key, bytes(value[:-4]))
    assert not store.read_into(h, torch.zeros_like(block))  # short

    redis_server.pause()  # hung: the read times out (socket_timeout, 0.5 s by default)
    t0 = time.monotonic()
    assert not store.read_into(h, torch.zeros_like(block))
    assert time.monotonic() - t0 < 3 and store.link.num_errors == 1
    redis_server.resume()

    redis_server.stop()
    store.link._down_until = 0.0  # past the back-off the timeout started
    t0 = time.monotonic()
    assert not store.read_into(h, torch.zeros_like(block))  # refused: a failed read, then the back-off
    assert probe([h]) == [False]
    store.write_async(h, block.clone())  # in back-off: dropped, counted
    store.flush()
    assert time.monotonic() - t0 < 5 and store.num_dropped_writes >= 1 and store.link.num_errors == 2


def test_lower_tiers_stack_disk_over_remote_and_count_per_tier(tmp_path):
    from kvserve.runtime.core.disk_index import DiskIndex

    a, b, c, d = (bytes([i]) * 16 for i in range(4))
    in_store = {b, c}
    asked = []

    def probe(hashes):
        asked.append(list(hashes))
        return [h in in_store for h in hashes]

    disk = DiskIndex(str(tmp_path / "none"), capacity_blocks=4)
    disk.add(a)
    tiers = LowerTiers(disk, RemoteIndex(probe))
    assert tiers.lookup([a, b, c, d]) == 3 and asked == [[b, c, d]]  # the store is asked only past the disk
    tiers.touch([a, b, c])
    tiers.discard([c])  # its read failed
    stats = tiers.stats()
    assert disk.num_hit_blocks == 1 and stats["kv_offload_remote_hit_blocks"] == 1
    assert stats["kv_offload_remote_failed_blocks"] == 1 and stats["kv_offload_disk_failed_blocks"] == 0
    assert b in tiers.remote and c not in tiers.remote  # c is written again by the next save of it
    assert b not in tiers  # the disk lacks it: a save writes it through
    tiers.add(b)
    assert b in tiers and tiers.take_deletions() == []


def test_flag_needs_the_host_tier_and_a_redis_url(model_dir):
    with pytest.raises(InvalidParameter, match="needs kv_offloading_size") as e:
        make_engine_config(model_dir, kv_offloading_remote_url="redis://127.0.0.1:1/0")
    assert e.value.param == "kv_offloading_remote_url"
    with pytest.raises(InvalidParameter, match="redis://") as e:
        make_engine_config(model_dir, kv_offloading_size=1.0, kv_offloading_remote_url="http://127.0.0.1:1")
    assert e.value.param == "kv_offloading_remote_url"


def _remote(url: str) -> dict:
    return dict(kv_offloading_remote_url=url)


def test_remote_tier_matches_off_and_serves_a_second_engine(model_dir, redis_server):
    first, second = conversations(12, seed=5)
    off, _, _ = run_rounds(model_dir, (first, second), 0)
    on, engine, _ = run_rounds(model_dir, (first, second), HOST_BLOCKS * BYTES_PER_BLOCK, **_remote(redis_server.url))
    assert on == off
    tiers = engine.kv_cache_manager.tier.disk
    assert isinstance(tiers, LowerTiers) and tiers.remote.num_written_blocks > 0
    engine.executor.runner.kv_transfer.flush()
    keys = redis_server.client().keys("kvserve:kv:*")
    prefix = remote_store.key_prefix(engine.config)
    assert keys and all(k.decode().startswith(prefix) for k in keys)

    # A second engine, empty device and host tiers: round 2 straight away, its prefixes from the store.
    again, engine2, _ = run_rounds(model_dir, (second,), HOST_BLOCKS * BYTES_PER_BLOCK, **_remote(redis_server.url))
    assert again == [off[1]]
    remote2 = engine2.kv_cache_manager.tier.disk.remote
    assert remote2.num_hit_blocks > 0 and remote2.num_failed_blocks == 0
    assert engine2.scheduler.num_offload_loaded_tokens > 0
    metrics = ServerMetrics("m", 256)
    metrics.update_from_stats(engine2.get_stats())
    text = generate_latest(metrics.registry).decode()
    labels = 'engine="0",model_name="m",tier="remote"'
    hits = f"kvserve:kv_offload_hit_blocks_total{{{labels}}} {float(remote2.num_hit_blocks)}"
    assert hits in text


def test_disk_and_remote_stacked(model_dir, redis_server, tmp_path):
    """Both lower tiers: written through to both; a new engine with an empty disk gets the store's blocks, one
    with the first engine's disk gets them from its disk first (the store is asked only past it); same tokens."""
    first, second = conversations(12, seed=13)
    off, _, _ = run_rounds(model_dir, (first, second), 0)
    size = 1024 * BYTES_PER_BLOCK / GIB
    tiers = dict(kv_offloading_disk_size=size, **_remote(redis_server.url))
    on, engine, _ = run_rounds(
        model_dir, (first, second), HOST_BLOCKS * BYTES_PER_BLOCK, kv_offloading_disk_dir=str(tmp_path / "a"), **tiers
    )
    assert on == off
    lower = engine.kv_cache_manager.tier.disk
    assert lower.disk.num_written_blocks > 0 and lower.remote.num_written_blocks == lower.disk.num_written_blocks
    assert "STORAGE" in {e.medium for e in engine.events if isinstance(e, StoredBlocks)}  # the disk's events
    engine.executor.runner.kv_transfer.flush()

    for directory, tier in (("b", "remote"), ("a", "disk")):
        again, engine2, _ = run_rounds(
            model_dir,
            (second,),
            HOST_BLOCKS * BYTES_PER_BLOCK,
            kv_offloading_disk_dir=str(tmp_path / directory),
            **tiers,
        )
        assert again == [off[1]], directory
        lower2 = engine2.kv_cache_manager.tier.disk
        hits = {"disk": lower2.disk.num_hit_blocks, "remote": lower2.remote.num_hit_blocks}
        # b (empty disk): everything from the store. a: from the disk first; the store may still add a block
        # or two the first engine never saved (a save is skipped when the host pool has no slot for it).
        assert hits[tier] > 0 and hits[tier] > sum(hits.values()) - hits[tier], (directory, hits)
        engine2.executor.runner.kv_transfer.flush()


def test_corrupt_values_cost_a_recompute_never_a_wrong_token(model_dir, redis_server):
    first, second = conversations(12, seed=7)
    off, _, _ = run_rounds(model_dir, (first, second), 0)
    _, engine, _ = run_rounds(model_dir, (first,), HOST_BLOCKS * BYTES_PER_BLOCK, **_remote(redis_server.url))
    engine.executor.runner.kv_transfer.flush()
    client = redis_server.client()
    keys = client.keys("kvserve:kv:*")
    assert keys
    for key in keys:  # one flipped bit in every value's payload
        value = bytearray(client.get(key))
        value[-1] ^= 0x01
        client.set(key, bytes(value))
    again, engine2, _ = run_rounds(model_dir, (second,), HOST_BLOCKS * BYTES_PER_BLOCK, **_remote(redis_server.url))
    assert again == [off[1]]
    remote2 = engine2.kv_cache_manager.tier.disk.remote
    assert remote2.num_failed_blocks > 0 and remote2.num_hit_blocks == 0
    # Whatever it loaded came from blocks it computed and saved itself, never a corrupt value.
    host = engine2.kv_cache_manager.host
    assert host.num_loaded_blocks * 16 == engine2.scheduler.num_offload_loaded_tokens


def test_store_down_mid_run_requests_still_complete(model_dir, redis_server):
    """The store dies between a lookup that found blocks and their reads (and stays down): those reads fail,
    the request recomputes, later lookups find nothing; every request completes with the same tokens."""
    first, second = conversations(12, seed=9)
    off, _, _ = run_rounds(model_dir, (first, second), 0)
    from kvserve.runtime import LLM, SamplingParams

    llm = LLM(
        model_dir,
        max_model_len=256,
        block_size=16,
        num_kv_blocks=18,
        kv_offloading_size=HOST_BLOCKS * BYTES_PER_BLOCK / GIB,
        **_remote(redis_server.url),
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in first], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == off[0]
    core = llm.engine.core
    core.executor.runner.kv_transfer.flush()
    store = core.executor.runner.kv_transfer.disk.remote
    read_into = store.read_into

    def read_after_the_store_died(block_hash, out):
        redis_server.stop()
        return read_into(block_hash, out)

    store.read_into = read_after_the_store_died
    t0 = time.monotonic()
    outs = llm.generate([{"prompt_token_ids": p} for p in second], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == off[1]
    assert time.monotonic() - t0 < 15
    remote = core.kv_cache_manager.tier.disk.remote
    assert remote.num_failed_blocks > 0 and remote.num_hit_blocks == 0 and store.link.num_errors >= 1

    # An engine started while the store is down: it starts, logs it, and serves (recomputing).
    again, engine3, _ = run_rounds(model_dir, (second,), HOST_BLOCKS * BYTES_PER_BLOCK, **_remote(redis_server.url))
    assert again == [off[1]] and engine3.kv_cache_manager.tier.disk.remote.num_hit_blocks == 0


def test_lora_adapters_never_share_blocks_through_the_store(redis_server, tmp_path):
    """The same prompts under two adapters and the base model; a second engine gets round 2's prefixes from the
    store: the adapter is in every block's key, so it never gets one adapter's KV for another (same tokens)."""
    modules = ",".join(
        f"{n}={make_random_adapter_dir(str(STORIES_DIR), str(tmp_path / n), rank=4, seed=s)}"
        for n, s in (("a", 1), ("b", 2))
    )
    lora = dict(enable_lora=True, lora_modules=modules, max_loras=2, max_lora_rank=4, dtype="float32", seed=0)
    lora.update(names=[n for n in ("a", None, "b") for _ in range(3)], max_model_len=128, num_kv_blocks=10)
    first, second = conversations(3, seed=9)
    first, second = [p[:60] for p in first] * 3, [p[:64] for p in second] * 3  # the same prompts per adapter
    off, _, _ = run_rounds(str(STORIES_DIR), (first, second), 0, **lora)
    assert off[0][0] != off[0][3] != off[0][6]  # the adapters change the tokens
    _, engine, _ = run_rounds(str(STORIES_DIR), (first,), 32 << 20, **lora, **_remote(redis_server.url))
    engine.executor.runner.kv_transfer.flush()
    again, engine2, _ = run_rounds(str(STORIES_DIR), (second,), 32 << 20, **lora, **_remote(redis_server.url))
    assert again == [off[1]]
    assert engine2.kv_cache_manager.tier.disk.remote.num_hit_blocks > 0


def _manifest(folder) -> None:
    """What `kvserve download` leaves beside the files (runtime/sources/download.py): size and sha256 per file."""
    import hashlib
    import json

    from kvserve.runtime.sources.download import MARKER

    files = {
        p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in sorted(folder.iterdir())
        if p.is_file()
    }
    (folder / MARKER).write_text(json.dumps({"source": "hf://x/y", "commit": "c", "files": files}))


def test_downloaded_copies_of_a_model_share_keys_a_modified_one_does_not(model_dir, tmp_path):
    """Two pods' downloads of one model: other paths, other mtimes, the same manifest -> the same keys."""
    import os
    import shutil

    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(model_dir, a)
    shutil.copytree(model_dir, b)
    for p in b.iterdir():
        os.utime(p, (1_000_000, 1_000_000))

    def prefix(folder) -> str:
        return remote_store.key_prefix(make_engine_config(str(folder)))

    assert prefix(a) != prefix(b)  # without a manifest: the disk tier's path and mtimes
    _manifest(a)
    _manifest(b)
    assert prefix(a) == prefix(b)
    weights = next(p for p in b.iterdir() if p.name.endswith(".safetensors"))
    with open(weights, "ab") as f:  # changed after the download: its own keys again
        f.write(b"\0")
    assert prefix(a) != prefix(b)


def test_a_store_that_evicts_costs_misses_not_errors(model_dir, redis_server):
    """The store's LRU (allkeys-lru, maxmemory about 48 blocks past its own use; values, keys and pipelined
    writes count against it) evicts most of what the first engine wrote: a second engine gets misses for the
    evicted blocks, no errors, and the same tokens."""
    first, second = conversations(12, seed=15)
    off, _, _ = run_rounds(model_dir, (first, second), 0)
    client = redis_server.client()
    client.config_set("maxmemory", client.info("memory")["used_memory"] + 48 * (BYTES_PER_BLOCK + 200))
    _, engine, _ = run_rounds(model_dir, (first, second), HOST_BLOCKS * BYTES_PER_BLOCK, **_remote(redis_server.url))
    engine.executor.runner.kv_transfer.flush()
    written = engine.kv_cache_manager.tier.disk.remote.num_written_blocks
    assert client.info("stats")["evicted_keys"] > 0 and client.dbsize() < written
    again, engine2, _ = run_rounds(model_dir, (second,), HOST_BLOCKS * BYTES_PER_BLOCK, **_remote(redis_server.url))
    assert again == [off[1]]

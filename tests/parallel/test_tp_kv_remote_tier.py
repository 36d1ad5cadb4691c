"""The remote KV tier (Redis) under tensor_parallel_size=2: each rank stores its shard under its own keys (the
global rank is in the layout fingerprint), and a value that one rank -- not the sampling one -- fails to read
is recomputed by all."""

from __future__ import annotations

import time

import pytest
from kv_offload_testing import BYTES_PER_BLOCK, conversations, run_rounds
from redis_testing import RedisServer

from kvserve.runtime.executor.remote_store import key_prefix


@pytest.fixture
def redis_server():
    server = RedisServer()
    yield server
    server.stop()


@pytest.mark.timeout(600)
def test_tp2_remote_tier_keys_each_shard_and_recomputes_a_bad_rank1_value(tp_model_factory, redis_server):
    model_dir, _ = tp_model_factory("llama_gqa")  # 2 KV heads: one per rank
    first, second = conversations(12, seed=11)
    remote = dict(kv_offloading_remote_url=redis_server.url, tensor_parallel_size=2)
    off, engine_off, _ = run_rounds(model_dir, (first, second), 0, tensor_parallel_size=2)
    engine_off.shutdown()
    on, engine, _ = run_rounds(model_dir, (first,), 8 * BYTES_PER_BLOCK, **remote)
    written = engine.kv_cache_manager.tier.disk.remote.num_written_blocks
    prefixes = [key_prefix(engine.config, rank) for rank in (0, 1)]
    client = redis_server.client()

    def keys(rank: int) -> list[bytes]:
        return sorted(client.keys(prefixes[rank] + "*"))

    deadline = time.monotonic() + 60  # the ranks' writer threads finish their queues
    while any(len(keys(r)) < written for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.2)
    engine.shutdown()
    assert on == [off[0]] and written > 0
    assert prefixes[0] != prefixes[1]  # each rank its own shard's keys
    k0, k1 = keys(0), keys(1)
    assert len(k0) == written and [k[len(prefixes[0]) :] for k in k0] == [k[len(prefixes[1]) :] for k in k1]

    # Half of rank 1's values corrupted (rank 0 samples; its own reads all succeed): a new engine with empty
    # local tiers serves the intact blocks from the store and recomputes the others on both ranks.
    for key in k1[::2]:
        value = bytearray(client.get(key))
        value[-1] ^= 0xFF
        client.set(key, bytes(value))
    again, engine2, _ = run_rounds(model_dir, (second,), 8 * BYTES_PER_BLOCK, **remote)
    index2 = engine2.kv_cache_manager.tier.disk.remote
    failed, hit = index2.num_failed_blocks, index2.num_hit_blocks
    engine2.shutdown()
    assert again == [off[1]]
    assert failed > 0 and hit > 0

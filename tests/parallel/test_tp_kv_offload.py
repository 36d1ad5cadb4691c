"""The host KV tier under tensor_parallel_size=2 and pipeline_parallel_size=2 (CPU/gloo): every rank saves and
loads its own shard (KV heads, or layers) through the same steps; greedy tokens identical with the tier on and off.
The disk tier under tensor_parallel_size=2: each rank files its shard in its own directory, and a block that one
rank -- not the sampling one -- fails to read is recomputed by all."""

from __future__ import annotations

import glob
import json
import os
import time

import pytest
from kv_offload_testing import BYTES_PER_BLOCK, GIB, conversations, run_rounds

from kvserve.runtime.core.disk_index import BLOCK_FILE_SUFFIX


@pytest.mark.timeout(600)
def test_tp2_tier_on_matches_off(tp_model_factory):
    model_dir, _ = tp_model_factory("llama_gqa")  # 2 KV heads: one per rank
    rounds = conversations(8, seed=4)
    off, engine_off, _ = run_rounds(model_dir, rounds, 0, tensor_parallel_size=2)
    engine_off.shutdown()
    on, engine, _ = run_rounds(model_dir, rounds, 256 * BYTES_PER_BLOCK, tensor_parallel_size=2)
    loaded = engine.scheduler.num_offload_loaded_tokens
    engine.shutdown()
    assert on == off
    assert loaded > 0


@pytest.mark.timeout(600)
def test_pp2_tier_on_matches_off(tp_model_factory):
    """Two pipeline stages with micro-batches in flight: each stage saves and loads its own layers; a step's
    connector section completes when its batch's output is applied (in launch order)."""
    model_dir, _ = tp_model_factory("llama_gqa")
    rounds = conversations(8, seed=6)
    off, engine_off, _ = run_rounds(model_dir, rounds, 0, pipeline_parallel_size=2)
    engine_off.shutdown()
    on, engine, _ = run_rounds(model_dir, rounds, 256 * BYTES_PER_BLOCK, pipeline_parallel_size=2)
    loaded = engine.scheduler.num_offload_loaded_tokens
    in_flight_max = engine.core.max_batches_in_flight
    engine.shutdown()
    assert on == off
    assert loaded > 0 and in_flight_max > 1


def _rank_dirs(root) -> dict[int, str]:
    """rank -> its store directory (layout.json names the rank)."""
    out = {}
    for layout in glob.glob(os.path.join(root, "kvserve-*", "layout.json")):
        out[json.load(open(layout))["rank"]] = os.path.dirname(layout)
    return out


def _block_files(d) -> list[str]:
    return sorted(f for f in glob.glob(os.path.join(d, "*")) if f.endswith(BLOCK_FILE_SUFFIX))


@pytest.mark.timeout(900)
def test_tp2_disk_tier_files_each_shard_and_recomputes_a_bad_rank1_block(tp_model_factory, tmp_path):
    model_dir, _ = tp_model_factory("llama_gqa")  # 2 KV heads: one per rank
    first, second = conversations(12, seed=3)
    disk = dict(kv_offloading_disk_dir=str(tmp_path), kv_offloading_disk_size=1024 * BYTES_PER_BLOCK / GIB)
    off, engine_off, _ = run_rounds(model_dir, (first, second), 0, tensor_parallel_size=2)
    engine_off.shutdown()
    # A host tier of 8 blocks: most of the history only the disk keeps, so round 2 fetches from it.
    on, engine, _ = run_rounds(model_dir, (first, second), 8 * BYTES_PER_BLOCK, tensor_parallel_size=2, **disk)
    index = engine.kv_cache_manager.tier.disk
    num_blocks, hits = index.num_blocks, index.num_hit_blocks
    dirs = _rank_dirs(tmp_path)
    deadline = time.monotonic() + 60  # the ranks' writer threads finish their queues
    while any(len(_block_files(d)) < num_blocks for d in dirs.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    engine.shutdown()
    assert on == off
    assert hits > 0 and engine.scheduler.num_offload_loaded_tokens > 0
    assert sorted(dirs) == [0, 1] and dirs[0] != dirs[1]  # each rank its own shard's directory
    files = {r: _block_files(d) for r, d in dirs.items()}
    assert [os.path.basename(f) for f in files[0]] == [os.path.basename(f) for f in files[1]]
    assert len(files[0]) == num_blocks

    # Half of rank 1's files corrupted (rank 0 samples; its own reads all succeed): a new engine of the same
    # layout serves the intact blocks from disk and recomputes the others on both ranks -- same tokens.
    for path in files[1][::2]:
        data = bytearray(open(path, "rb").read())
        data[-1] ^= 0xFF
        open(path, "wb").write(bytes(data))
    again, engine2, _ = run_rounds(model_dir, (second,), 8 * BYTES_PER_BLOCK, tensor_parallel_size=2, **disk)
    index2 = engine2.kv_cache_manager.tier.disk
    restored, failed, hit = index2.num_restored_blocks, index2.num_failed_blocks, index2.num_hit_blocks
    engine2.shutdown()
    assert again == [off[1]]
    assert restored == num_blocks
    assert failed > 0 and hit > 0


@pytest.mark.timeout(900)
def test_pp2_disk_tier_matches_off(tp_model_factory, tmp_path):
    """Two pipeline stages, micro-batches in flight: each stage files its layers; the fetch steps' agreement
    (a collective over both stages) neither deadlocks with the stages' sends nor changes a token."""
    model_dir, _ = tp_model_factory("llama_gqa")
    first, second = conversations(12, seed=3)
    disk = dict(kv_offloading_disk_dir=str(tmp_path), kv_offloading_disk_size=1024 * BYTES_PER_BLOCK / GIB)
    off, engine_off, _ = run_rounds(model_dir, (first, second), 0, pipeline_parallel_size=2)
    engine_off.shutdown()
    on, engine, _ = run_rounds(model_dir, (first, second), 8 * BYTES_PER_BLOCK, pipeline_parallel_size=2, **disk)
    hits = engine.kv_cache_manager.tier.disk.num_hit_blocks
    engine.shutdown()
    assert on == off
    assert hits > 0
    assert sorted(_rank_dirs(tmp_path)) == [0, 1]

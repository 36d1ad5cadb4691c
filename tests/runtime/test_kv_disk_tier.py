"""The local disk KV tier (--kv-offloading-disk-dir/-size): files checksummed and written by a thread, an index
restored by a new engine of the same layout, a corrupt or missing block recomputed (never a wrong token)."""

from __future__ import annotations

import os

import pytest
import torch
from kv_offload_testing import BLOCK, BYTES_PER_BLOCK, GIB, conversations, run_rounds
from prometheus_client import generate_latest

from kvserve.runtime.core.disk_index import BLOCK_FILE_SUFFIX, DiskIndex, block_file_name
from kvserve.runtime.core.kv_cache_events import StoredBlocks
from kvserve.runtime.executor.disk_store import DiskStore
from kvserve.runtime.metrics import ServerMetrics


def test_store_round_trip_and_a_corrupt_file_fails(tmp_path):
    store = DiskStore(str(tmp_path))
    block = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).view(2, 3, 4, 5)
    store.write_async(b"\x01" * 16, block.clone())
    store.flush()
    out = torch.zeros_like(block)
    assert store.read_into(b"\x01" * 16, out) and torch.equal(out, block)
    assert not store.read_into(b"\x02" * 16, out)  # missing
    path = tmp_path / block_file_name(b"\x01" * 16)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert not store.read_into(b"\x01" * 16, torch.zeros_like(block))  # checksum
    path.write_bytes(bytes(data[:-4]))
    assert not store.read_into(b"\x01" * 16, torch.zeros_like(block))  # short


def test_index_restores_lru_and_deletes_beyond_capacity(tmp_path):
    for i in range(3):
        (tmp_path / block_file_name(bytes([i]) * 16)).write_bytes(b"x")
        os.utime(tmp_path / block_file_name(bytes([i]) * 16), (i, i))
    (tmp_path / "layout.json").write_text("{}")
    index = DiskIndex(str(tmp_path), capacity_blocks=3)
    assert index.num_restored_blocks == 3 and index.lookup([bytes([0]) * 16, bytes([1]) * 16]) == 2
    index.touch([bytes([0]) * 16])  # block 1 is now the oldest
    index.add(b"\x09" * 16)
    assert index.take_deletions() == [bytes([1]) * 16]
    index.discard([b"\x09" * 16])
    assert b"\x09" * 16 not in index and index.take_deletions() == [b"\x09" * 16]


def _block_files(root) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(BLOCK_FILE_SUFFIX)]


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory("llama_gqa")[0]


def test_disk_tier_matches_off_survives_restart_and_recomputes_corrupt_blocks(model_dir, tmp_path):
    first, second = conversations(12, seed=3)
    disk = dict(kv_offloading_disk_dir=str(tmp_path), kv_offloading_disk_size=1024 * BYTES_PER_BLOCK / GIB)
    off, _, _ = run_rounds(model_dir, (first, second), 0)
    # A host tier of 8 blocks: most of the history only the disk keeps.
    on, engine, _ = run_rounds(model_dir, (first, second), 8 * BYTES_PER_BLOCK, **disk)
    assert on == off
    index = engine.kv_cache_manager.tier.disk
    assert index.num_written_blocks > 0 and engine.scheduler.num_offload_loaded_tokens > 0
    assert {e.medium for e in engine.events if isinstance(e, StoredBlocks)} == {None, "CPU", "STORAGE"}
    engine.executor.runner.kv_transfer.flush()
    files = _block_files(tmp_path)
    assert len(files) == index.num_blocks

    # A new engine with the same model and layout: round 2 straight away, prefixes from the first engine's files.
    again, engine2, _ = run_rounds(model_dir, (second,), 8 * BYTES_PER_BLOCK, **disk)
    assert again == [off[1]]
    index2 = engine2.kv_cache_manager.tier.disk
    assert index2.num_restored_blocks == len(files) and engine2.scheduler.num_offload_loaded_tokens > 0
    metrics = ServerMetrics("m", 256)
    metrics.update_from_stats(engine2.get_stats())
    text = generate_latest(metrics.registry).decode()
    hits = (
        f'kvserve:kv_offload_hit_blocks_total{{engine="0",model_name="m",tier="disk"}} {float(index2.num_hit_blocks)}'
    )
    assert index2.num_hit_blocks > 0 and hits in text
    engine2.executor.runner.kv_transfer.flush()

    # Every file corrupted: a third engine recomputes instead (same tokens), and drops the bad files.
    for path in _block_files(tmp_path):
        data = bytearray(open(path, "rb").read())
        data[-1] ^= 0xFF
        open(path, "wb").write(bytes(data))
    third, engine3, _ = run_rounds(model_dir, (second,), 8 * BYTES_PER_BLOCK, **disk)
    assert third == [off[1]]
    index3 = engine3.kv_cache_manager.tier.disk
    assert index3.num_failed_blocks > 0
    # Whatever the third engine loaded came from blocks it computed and saved itself, never a corrupt file.
    assert engine3.kv_cache_manager.host.num_loaded_blocks * BLOCK == engine3.scheduler.num_offload_loaded_tokens


def test_the_block_layout_names_the_directory(model_dir, tmp_path, monkeypatch):
    """The element order of a block (the attention backend's kv_block_layout: the CPU backend keeps bf16 blocks in
    the AMX block layout on AMX CPUs) is a layout fact: the scheduler's index and the runner's files share one
    directory, named with it, and an engine ordering its blocks the other way never reads them."""
    import json

    first, _ = conversations(4, seed=5)
    disk = dict(kv_offloading_disk_dir=str(tmp_path), kv_offloading_disk_size=256 * BYTES_PER_BLOCK / GIB)
    kw = dict(dtype="bfloat16", attention_backend="cpu", **disk)
    layouts = {}
    for packed in ("1", "0"):
        monkeypatch.setenv("KVSERVE_CPU_KV_PACKED", packed)
        _, engine, _ = run_rounds(model_dir, (first,), 8 * BYTES_PER_BLOCK, **kw)
        runner = engine.executor.runner
        runner.kv_transfer.flush()
        index = engine.kv_cache_manager.tier.disk
        assert index.directory == runner.disk_store.directory
        assert engine.config.cache.kv_block_layout == runner.kv_block_layout
        with open(os.path.join(index.directory, "layout.json")) as f:
            assert json.load(f)["kv_block_layout"] == runner.kv_block_layout
        layouts[runner.kv_block_layout] = (index.directory, index.num_restored_blocks)
    assert layouts.get("token") is not None
    if "amx-bf16" in layouts:  # an AMX CPU: two layouts, two directories, nothing restored across them
        assert layouts["amx-bf16"][0] != layouts["token"][0] and layouts["token"][1] == 0
    else:
        assert len(layouts) == 1

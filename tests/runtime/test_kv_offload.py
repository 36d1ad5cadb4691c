"""The host KV tier (--kv-offloading-size): greedy tokens identical with the tier on and off on a multi-turn
workload whose prefixes do not fit the device pool, and prefix blocks coming back from host RAM instead of
being recomputed."""

from __future__ import annotations

import pytest
from kv_offload_testing import BLOCK, BYTES_PER_BLOCK, conversations, run_rounds
from kvserve_testing import STORIES_DIR
from prometheus_client import generate_latest

from kvserve.runtime.config import make_engine_config
from kvserve.runtime.core.kv_cache_events import StoredBlocks
from kvserve.runtime.errors import InvalidParameter
from kvserve.runtime.metrics import ServerMetrics
from kvserve.runtime.models.synthetic import make_random_adapter_dir


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory("llama_gqa")[0]


def test_tier_on_matches_off_and_loads_instead_of_recomputing(model_dir):
    rounds = conversations(12, seed=3)
    off, engine_off, computed_off = run_rounds(model_dir, rounds, 0)
    on, engine, computed_on = run_rounds(model_dir, rounds, 256 * BYTES_PER_BLOCK)
    assert on == off
    kv = engine.kv_cache_manager
    loaded = engine.scheduler.num_offload_loaded_tokens
    assert loaded > 0 and kv.host.num_loaded_blocks * BLOCK == loaded
    assert kv.host.num_saved_blocks > 0
    # Every loaded token is one the forward did not compute.
    assert computed_on < computed_off
    assert engine_off.kv_cache_manager.tier is None and engine_off.scheduler.num_offload_loaded_tokens == 0
    # KV events: the host tier's stores carry medium CPU, the device's none (the publisher's GPU).
    media = {e.medium for e in engine.events if isinstance(e, StoredBlocks)}
    assert media == {None, "CPU"}
    # Prometheus: per tier, hits and bytes moved.
    stats = engine.get_stats()
    assert stats.kv_offload_loaded_blocks * BLOCK == loaded and stats.kv_offload_block_bytes == BYTES_PER_BLOCK
    metrics = ServerMetrics("m", 256)
    metrics.update_from_stats(stats)
    text = generate_latest(metrics.registry).decode()
    hits = f'kvserve:kv_offload_hit_blocks_total{{engine="0",model_name="m",tier="cpu"}} {float(loaded // BLOCK)}'
    assert hits in text
    loaded_bytes = float(loaded // BLOCK * BYTES_PER_BLOCK)
    assert f'kvserve:kv_offload_bytes_total{{engine="0",model_name="m",op="load",tier="cpu"}} {loaded_bytes}' in text


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tier_under_preemption(model_dir, mode):
    """17 blocks and 40 new tokens per request: requests are preempted while the tier saves and loads. With
    the tier on a swap preemption goes through the tier (one mechanism: the victim's full blocks are there
    already, it comes back as loads); with it off it swaps. Tokens identical either way."""
    rounds = conversations(8, seed=5)
    kwargs = dict(max_num_batched_tokens=64, preemption_mode=mode, max_tokens=40)
    if mode == "swap":
        kwargs["swap_space_bytes"] = 32 * BYTES_PER_BLOCK
    off, engine_off, _ = run_rounds(model_dir, rounds, 0, **kwargs)
    on, engine, _ = run_rounds(model_dir, rounds, 64 * BYTES_PER_BLOCK, **kwargs)
    assert on == off
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.num_offload_loaded_tokens > 0
    if mode == "swap":
        assert engine_off.scheduler.num_swap_outs > 0 and engine.scheduler.num_swap_outs == 0
        assert engine.kv_cache_manager.host.num_blocks == 96  # one pool: the swap space adds to the tier
    assert not engine.kv_cache_manager.req_to_host_blocks


def test_tier_with_lora_adapters(tmp_path):
    """The same conversations under two adapters and the base model: the adapter is part of every block's key,
    so the tier never hands one adapter's KV to another (tokens equal with the tier off)."""
    modules = ",".join(
        f"{n}={make_random_adapter_dir(str(STORIES_DIR), str(tmp_path / n), rank=4, seed=s)}"
        for n, s in (("a", 1), ("b", 2))
    )
    lora = dict(enable_lora=True, lora_modules=modules, max_loras=2, max_lora_rank=4, dtype="float32", seed=0)
    first, second = conversations(3, seed=9)
    first, second = [p[:60] for p in first] * 3, [p[:64] for p in second] * 3  # the same prompts per adapter
    names = [n for n in ("a", None, "b") for _ in range(3)]
    rounds = (first, second)
    off, _, _ = run_rounds(str(STORIES_DIR), rounds, 0, names=names, max_model_len=128, num_kv_blocks=10, **lora)
    on, engine, _ = run_rounds(
        str(STORIES_DIR), rounds, 32 << 20, names=names, max_model_len=128, num_kv_blocks=10, **lora
    )
    assert on == off
    assert on[0][0] != on[0][3] != on[0][6]  # the adapters change the tokens
    assert engine.scheduler.num_offload_loaded_tokens > 0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(kv_offloading_size=-1.0), "kv_offloading_size"),
        (dict(kv_offloading_size=1.0, enable_prefix_caching=False), "kv_offloading_size"),
        (dict(kv_offloading_disk_dir="/tmp/x"), "kv_offloading_disk_dir"),
        (dict(kv_offloading_size=1.0, kv_offloading_disk_dir="/tmp/x"), "kv_offloading_disk_size"),
        (dict(kv_offloading_disk_size=1.0), "kv_offloading_disk_size"),
    ],
)
def test_bad_offload_settings_name_their_field(model_dir, kwargs, field):
    with pytest.raises(InvalidParameter) as info:
        make_engine_config(model_dir, **kwargs)
    assert info.value.param == field

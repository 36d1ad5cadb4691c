"""The host KV tier under tensor_parallel_size=2 and pipeline_parallel_size=2 (CPU/gloo): every rank saves and
loads its own shard (KV heads, or layers) through the same steps; greedy tokens identical with the tier on and off."""

from __future__ import annotations

import pytest
from kv_offload_testing import BYTES_PER_BLOCK, conversations, run_rounds


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

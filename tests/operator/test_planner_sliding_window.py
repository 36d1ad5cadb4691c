"""Sliding-window models are planned per KV cache group: global layers for the whole context, sliding layers
for their window plus one step (what the runtime's KV manager keeps), next to the full-context charge."""

from __future__ import annotations

import dataclasses
import json

from kvserve.cli import plan as plan_cli
from kvserve.runtime import capacity
from kvserve.runtime.planner import catalog, kv_plan

# Gemma-3-27B's text stack (not in the catalog: its checkpoint is multimodal): 62 layers, 10 global.
GEMMA3_27B = capacity.ModelShape(
    62,
    32,
    16,
    128,
    5376,
    27_000_000_000,
    131072,
    21504,
    262144,
    architecture="Gemma3ForCausalLM",
    tie_word_embeddings=True,
    qk_norm=True,
    num_layer_norms=4,
    sliding_window=1024,
    num_sliding_layers=52,
)


def test_groups_follow_vllm_hybrid_layout():
    groups = capacity.shape_kv_cache_groups(GEMMA3_27B)
    # group size 10 = the global layers: 1 full group + ceil(52 / 10) = 6 sliding groups (8 padding slots)
    assert [g.sliding_window for g in groups] == [0] + [1024] * 6
    assert [len(g.layers) for g in groups] == [10, 10, 10, 10, 10, 10, 2]
    gemma2 = capacity.kv_cache_groups(
        capacity.layer_windows(capacity.gemma_layer_types({"model_type": "gemma2", "num_hidden_layers": 6}), 4096)
    )
    assert gemma2 == (capacity.KVCacheGroup(0, (1, 3, 5)), capacity.KVCacheGroup(4096, (0, 2, 4)))
    gemma3 = capacity.gemma_layer_types({"model_type": "gemma3_text", "num_hidden_layers": 12})
    assert [i for i, t in enumerate(gemma3) if t == "full_attention"] == [5, 11]


def test_gemma3_27b_charge_matches_the_worked_example():
    # bf16, block 16, 32K request, 2048-token steps (model_families.md 9.6): per-layer KV is 8 KiB per token.
    layout = capacity.kv_layout(GEMMA3_27B, "bfloat16", "auto", 16, 1)
    assert layout.bytes_per_block == 16 * 10 * 8 * 1024  # one block id = 10 layers x 16 tokens
    sliding_blocks = -(-(1024 - 1 + 2048) // 16) + 1  # window - 1 + one step, + 1 for the unaligned start
    assert sliding_blocks == 193
    assert layout.blocks_per_sequence(32768, 2048) == 2048 + 6 * sliding_blocks
    full_charge = 62 * 32768 * 8 * 1024  # 15.5 GiB if every layer kept the whole context
    hybrid = layout.budget_for_blocks(layout.blocks_per_sequence(32768, 2048))
    assert hybrid == 2.5 * 2**30 + 6 * 193 * 16 * 10 * 8 * 1024  # ~3.9 GiB incl. the 8 padding slots
    assert full_charge / hybrid > 3.9
    # A sequence shorter than the window is charged in full either way.
    assert layout.blocks_per_sequence(512, 2048) == 7 * 32


def test_plan_reports_the_saving_next_to_the_full_context_charge():
    inp = kv_plan.PlanInput(
        model=catalog.MODELS["gemma-2-9b"],
        gpu_memory_bytes=catalog.GPUS["l40s"].memory_bytes,
        max_model_len=8192,
        max_num_batched_tokens=2048,
    )
    p = kv_plan.plan(inp)
    assert p.fits and p.num_kv_cache_groups == 2 and p.sliding_window == 4096
    blocks = p.num_blocks_per_gpu - 1
    # 21 global layers x 512 blocks + 21 sliding layers x (ceil((4095 + 2048) / 16) + 1 = 385) blocks
    assert p.max_concurrency == blocks // (512 + 385)
    assert p.max_concurrency_full_context == blocks // (2 * 512)  # a full-context block holds all 42 layers
    assert p.max_concurrency > p.max_concurrency_full_context
    assert "if every layer kept the full context" in p.message
    # Full-attention models are unchanged.
    llama = kv_plan.plan(dataclasses.replace(inp, model=catalog.MODELS["llama-3-8b"]))
    assert llama.num_kv_cache_groups == 1 and llama.max_concurrency == llama.max_concurrency_full_context


def test_kvserve_plan_shows_the_sliding_window_saving(capsys):
    import argparse

    parser = argparse.ArgumentParser()
    plan_cli.add_arguments(parser)
    assert plan_cli.run(parser.parse_args(["--model", "gemma-3-1b", "--gpu", "l4", "--max-model-len", "32768"])) == 0
    table = capsys.readouterr().out
    assert "sliding window (KV cache groups)" in table and "512 tokens (7 groups)" in table
    assert (
        plan_cli.run(
            parser.parse_args(["--model", "gemma-3-1b", "--gpu", "l4", "--max-model-len", "32768", "-o", "json"])
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["max_concurrency"] > 2 * out["max_concurrency_full_context"]

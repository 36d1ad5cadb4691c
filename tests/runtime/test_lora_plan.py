"""The adapter slots come off the KV budget (issue 24 item 7): `kvserve plan --enable-lora --max-loras N
--max-lora-rank R` charges exactly the bytes the served engine's LoraManager allocates
(capacity.lora_slot_bytes_per_rank, the one formula), and the engine given the plan's --kv-cache-bytes
reports the plan's block count. Per-rank slot bytes under tensor parallelism: test_lora_tp_shard.py."""

from __future__ import annotations

import json

import pytest

from kvserve.cli.main import main

LORA = ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "8"]
# A small budget (the CRD's smallest GPU, 1 GiB, at its lowest utilization 0.1: 102 MiB) with no activation / overhead
# reserve, so the KV cache this test allocates on CPU stays small.
GPU = [
    *("--gpu", "a100-80gb", "--gpu-memory-mib", "1024", "--gpu-memory-utilization", "0.1"),
    *("--activation-reserve-mib", "0", "--runtime-overhead-mib", "0"),
]


def _plan(model_dir: str, flags: list[str], capsys) -> dict:
    rc = main(["plan", "--model-config", model_dir, *GPU, "-o", "json", *flags])
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out)


@pytest.mark.parametrize("tp", [1, 2])
def test_plan_takes_the_slots_off_the_kv_budget(model_factory, capsys, tp):
    from kvserve.runtime import capacity

    model_dir, _ = model_factory("llama_gqa")
    base = _plan(model_dir, ["-tp", str(tp)], capsys)
    lora = _plan(model_dir, ["-tp", str(tp), *LORA], capsys)
    shape = capacity.shape_from_hf_config(json.load(open(f"{model_dir}/config.json")))
    slots = capacity.lora_slot_bytes_per_rank(shape, 3, 8, "float32", tp)
    assert base["lora_slot_bytes_per_gpu"] == 0 and lora["lora_slot_bytes_per_gpu"] == slots > 0
    layout = capacity.kv_layout(shape, "float32", "auto", base["block_size"], tp)
    free = base["memory_budget_bytes_per_gpu"] - base["weight_bytes_per_gpu"]  # no activation/overhead reserve
    assert base["num_blocks_per_gpu"] == layout.blocks_for_budget(free)
    assert lora["num_blocks_per_gpu"] == layout.blocks_for_budget(free - slots) < base["num_blocks_per_gpu"]
    assert lora["kv_cache_bytes_per_gpu"] == layout.budget_for_blocks(lora["num_blocks_per_gpu"])


def test_served_engine_allocates_the_planned_slots_and_blocks(model_factory, capsys):
    """The server the same flags start, given the plan's --kv-cache-bytes: the blocks it reports and the slot
    bytes it allocated (measured on its LoraManager's tensors) are the plan's."""
    from kvserve.runtime import LLM

    model_dir, _ = model_factory("llama_gqa")
    plan = _plan(model_dir, LORA, capsys)
    llm = LLM(
        model_dir,
        enable_lora=True,
        max_loras=3,
        max_lora_rank=8,
        kv_cache_bytes=plan["kv_cache_bytes_per_gpu"],
        max_model_len=plan["engine"]["max_model_len"],
    )
    try:
        runner = llm.engine.executor.runner
        allocated = sum(t.numel() * t.element_size() for s in runner.lora.slots.values() for t in (s.a, s.b))
        assert allocated == plan["lora_slot_bytes_per_gpu"]
        assert runner.num_blocks == plan["num_blocks_per_gpu"]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("key", ["qwen3_moe", "mixtral_moe"])
def test_moe_slots_are_the_dense_layers_and_attention_only(model_factory, key):
    """A sparse MoE layer's experts take no adapter: only attention and dense-MLP layers have slots."""
    import torch

    from kvserve.runtime import capacity
    from kvserve.runtime.config import LoraConfig, load_model_config
    from kvserve.runtime.lora.engine_hooks import build_manager
    from kvserve.runtime.models.attention_backends import get_attention_backend
    from kvserve.runtime.models.loader import load_model

    model_dir, _ = model_factory(key)
    config = load_model_config(model_dir, "float32")
    model = load_model(config, get_attention_backend("torch"), "cpu", load_format="auto")
    manager = build_manager(model, LoraConfig((), 2, 4, 2), torch.float32, torch.device("cpu"))
    allocated = sum(t.numel() * t.element_size() for s in manager.slots.values() for t in (s.a, s.b))
    assert allocated == capacity.lora_slot_bytes_per_rank(config.shape, 2, 4, "float32")

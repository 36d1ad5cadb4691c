"""Capacity planner: the seed's worked figures, the realistic figure, and every catalog entry."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from kvserve.runtime import capacity
from kvserve.runtime.planner import catalog, kv_plan
from kvserve.runtime.planner.catalog import GiB, MiB

L70 = catalog.MODELS["llama-3-70b"]


def kv_per_token(model, dtype="bfloat16") -> int:
    return capacity.kv_layout(model, dtype, "auto", 16, 1).bytes_per_token


def test_seed_kv_bytes_per_token_llama3_70b_fp16():
    # 2 (K and V) x 80 layers x 8 KV heads x 128 head dim x 2 bytes
    assert kv_per_token(L70) == 327_680
    # The seed's "320 KB" is 320 KiB; in decimal units it is 327.68 kB.
    assert 327_680 == 320 * 1024


def test_seed_bytes_per_32k_sequence_gb_vs_gib():
    per_token = kv_per_token(L70)
    # "32k" read as 32,768 tokens is exactly 10 GiB = 10.74 GB ...
    assert per_token * 32_768 == 10 * GiB
    assert round(per_token * 32_768 / 1e9, 2) == 10.74
    # ... the seed's "~10.5 GB" is 32,000 tokens in decimal GB (10.49 GB).
    assert round(per_token * 32_000 / 1e9, 1) == 10.5


def test_seed_concurrency_when_everything_but_weights_is_kv():
    # Seed: 4x A100-80GB = 320 GB, minus 140 GB of weights = 180 GB of KV -> "~17" 32k sequences.
    per_token = kv_per_token(L70)
    kv_bytes = 4 * 80e9 - 140e9
    assert kv_bytes // (per_token * 32_000) == 17  # the seed's figure: 32k = 32,000 tokens, GB
    assert kv_bytes // (per_token * 32_768) == 16  # 32k = 32,768 tokens: 16.8 -> 16 whole sequences
    # An "80GB" A100 really has 80 GiB (85.9 GB): 4 x 80 GiB - 140 GB leaves room for 18.
    assert (4 * 80 * GiB - 140e9) // (per_token * 32_768) == 18

    # The planner reproduces the seed's idealisation: all memory usable, no activations/overhead,
    # 140 GB of weights (70e9 parameters x 2 bytes) split over TP=4, 80 GB per GPU.
    seed_model = dataclasses.replace(L70, num_parameters=70_000_000_000, max_position_embeddings=32_768)
    ideal = dict(
        model=seed_model,
        gpu_memory_bytes=80_000_000_000,
        tensor_parallel_size=4,
        gpu_memory_utilization=1.0,
        activation_reserve_bytes=0,
        runtime_overhead_bytes=0,
    )
    assert kv_plan.plan(kv_plan.PlanInput(**ideal, max_model_len=32_000)).max_concurrency == 17
    assert kv_plan.plan(kv_plan.PlanInput(**ideal, max_model_len=32_768)).max_concurrency == 16


def test_realistic_figure_utilization_092_with_overheads():
    p = kv_plan.plan(
        kv_plan.PlanInput(
            model=dataclasses.replace(L70, max_position_embeddings=32_768),
            gpu_memory_bytes=catalog.GPUS["a100-80gb"].memory_bytes,
            tensor_parallel_size=4,
            gpu_memory_utilization=0.92,
            max_model_len=32_768,
        )
    )
    budget = int(80 * GiB * 0.92)
    # 70.55e9 x 2 B / 4, plus the norms every rank holds whole (80 x 2 + 1 vectors of 8192, 2 B each x 3/4)
    weights = math.ceil(70_553_706_496 * 2 / 4) + (80 * 2 + 1) * 8192 * 2 * 3 // 4
    assert weights == capacity.weight_bytes_per_rank(L70, "bfloat16", 4)
    # activations: 8192 batched tokens x (6 x 8192 hidden + 2 x 28672/4 MLP) x 2 B, fp32 logits for 256 seqs, 1 GiB
    activations = 8192 * (6 * 8192 + 2 * 28672 // 4) * 2 + 256 * 128_256 * 4 + GiB
    overhead = int(0.6 * GiB)
    per_gpu_block = 16 * 327_680 // 4
    blocks = (budget - weights - activations - overhead) // per_gpu_block
    assert (p.weight_bytes_per_gpu, p.activation_reserve_bytes, p.runtime_overhead_bytes) == (
        weights,
        activations,
        overhead,
    )
    assert p.num_blocks_per_gpu == blocks
    assert p.kv_tokens == (blocks - 1) * 16  # block 0 is the runtime's null block
    assert p.kv_cache_bytes_per_gpu == blocks * per_gpu_block
    assert p.max_concurrency == (blocks - 1) // (32_768 // 16)
    assert p.max_model_len_fit == 32_768  # KV would hold a longer one; the model's positions cap it
    # The realistic answer is 15 concurrent 32k sequences per replica, not the seed's ~17.
    assert p.max_concurrency == 15 and p.fits and p.reason == "Fits"


def test_fp8_kv_cache_halves_bytes_per_token_and_doubles_tokens():
    base = dict(
        model=L70,
        gpu_memory_bytes=80 * GiB,
        tensor_parallel_size=4,
        activation_reserve_bytes=0,
        runtime_overhead_bytes=0,
        gpu_memory_utilization=0.9,
    )
    auto = kv_plan.plan(kv_plan.PlanInput(**base))
    fp8 = kv_plan.plan(kv_plan.PlanInput(**base, kv_cache_dtype="fp8"))
    assert fp8.kv_bytes_per_token * 2 == auto.kv_bytes_per_token == 327_680
    assert fp8.kv_bytes_per_token_per_gpu * 2 == auto.kv_bytes_per_token_per_gpu
    # usable = blocks - 1 (null block); fp8 buys 2x the blocks, or one more after rounding
    assert fp8.kv_tokens in (2 * auto.kv_tokens + 16, 2 * auto.kv_tokens + 32)
    assert fp8.weight_bytes == auto.weight_bytes  # KV dtype does not touch the weights


def test_kv_heads_split_across_ranks_and_replicated_beyond():
    one = kv_plan.plan(kv_plan.PlanInput(model=L70, gpu_memory_bytes=141 * GiB, tensor_parallel_size=1))
    eight = kv_plan.plan(kv_plan.PlanInput(model=L70, gpu_memory_bytes=141 * GiB, tensor_parallel_size=8))
    assert one.kv_bytes_per_token_per_gpu == 8 * eight.kv_bytes_per_token_per_gpu
    # Qwen2.5-7B has 4 KV heads: at TP=4 each rank holds 1; a hypothetical 2 KV-head model at TP=4 replicates.
    q7 = catalog.MODELS["qwen2.5-7b"]
    assert kv_plan.kv_heads_per_rank(q7, 4) == 1
    assert kv_plan.kv_heads_per_rank(dataclasses.replace(q7, num_kv_heads=2), 4) == 1


@pytest.mark.parametrize(
    "reason,kwargs",
    [
        ("WeightsDoNotFit", dict(model=L70, gpu_memory_bytes=catalog.GPUS["a100-80gb"].memory_bytes)),
        (
            "ContextDoesNotFit",
            dict(
                model=dataclasses.replace(L70, max_position_embeddings=131_072),
                gpu_memory_bytes=catalog.GPUS["a100-80gb"].memory_bytes,
                tensor_parallel_size=2,
                max_model_len=131_072,
            ),
        ),
        (
            "InvalidTensorParallelSize",
            dict(model=catalog.MODELS["qwen2.5-7b"], gpu_memory_bytes=80 * GiB, tensor_parallel_size=8),
        ),
        (
            "ContextExceedsModel",
            dict(model=L70, gpu_memory_bytes=80 * GiB, tensor_parallel_size=4, max_model_len=16_384),
        ),
    ],
)
def test_impossible_specs_say_why_with_numbers(reason, kwargs):
    p = kv_plan.plan(kv_plan.PlanInput(**kwargs))
    assert not p.fits and p.reason == reason
    assert re.search(r"\d", p.message)
    if reason == "ContextDoesNotFit":
        assert 0 < p.max_model_len_fit < 131_072 and str(p.max_model_len_fit) in p.message
        assert p.max_concurrency == 0
    if reason == "WeightsDoNotFit":
        assert p.num_blocks_per_gpu == 0 and p.kv_cache_bytes_per_gpu == 0


# Widely published per-token KV sizes (fp16/bf16): Llama-2-7B 512 KiB (MHA), Llama-3-8B 128 KiB (GQA 8),
# Llama-3-70B 320 KiB, Llama-3.1-405B 504 KiB, Qwen2.5-7B 56 KiB (4 KV heads, 28 layers).
KNOWN_KV_KIB = {
    "llama-2-7b": 512,
    "llama-3-8b": 128,
    "llama-3.1-8b": 128,
    "llama-3-70b": 320,
    "llama-3.1-405b": 504,
    "qwen2.5-7b": 56,
    "mistral-7b": 128,
    "llama-2-13b": 800,
    "qwen3-8b": 144,
    "gemma-2-9b": 336,
}
NOMINAL_BILLIONS = {
    "mixtral-8x7b": 46.7,
    "qwen3-30b-a3b": 30.5,
    "qwen3-235b-a22b": 235,
    "gemma-2-2b": 2.6,
}  # Google counts the 256K-row embedding out of "2B"
# Qwen3 and Gemma size q/k/v from an explicit head_dim: heads x head_dim may differ from hidden_size.
EXPLICIT_HEAD_DIM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")


@pytest.mark.parametrize("key", sorted(catalog.MODELS))
def test_every_model_entry(key):
    m = catalog.MODELS[key]
    assert m.head_dim * m.num_attention_heads == m.hidden_size or m.architecture in EXPLICIT_HEAD_DIM
    assert m.num_attention_heads % m.num_kv_heads == 0
    if key in KNOWN_KV_KIB:
        assert kv_per_token(m) == KNOWN_KV_KIB[key] * 1024
    nominal = NOMINAL_BILLIONS.get(key) or float(re.search(r"-(\d+)b$", key).group(1))
    assert abs(m.num_parameters / 1e9 - nominal) / nominal < 0.1, "parameter count far from the model's name"
    assert catalog.lookup_model(f"org/{key.upper()}-Instruct") == m
    # Every model fits somewhere: the smallest valid TP on B200s at 4k context.
    sizes = kv_plan.valid_tensor_parallel_sizes(m)
    assert 1 in sizes
    plans = [
        kv_plan.plan(
            kv_plan.PlanInput(
                model=m, gpu_memory_bytes=catalog.GPUS["b200"].memory_bytes, tensor_parallel_size=t, max_model_len=4096
            )
        )
        for t in sizes
    ]
    if capacity.unsupported_architecture_error(m):  # the planner refuses what the runtime cannot serve
        assert {p.reason for p in plans} == {"UnsupportedArchitecture"}
        return
    assert any(p.fits for p in plans)
    fitting = [p for p in plans if p.fits]
    # More GPUs never hold fewer tokens.
    assert [p.kv_tokens for p in fitting] == sorted(p.kv_tokens for p in fitting)


@pytest.mark.parametrize("key", sorted(catalog.GPUS))
def test_every_gpu_entry(key):
    gpu = catalog.GPUS[key]
    nominal_gb = {
        "a10g": 24,
        "l4": 24,
        "l40s": 48,
        "a100-40gb": 40,
        "a100-80gb": 80,
        "h100-80gb": 80,
        "h200-141gb": 141,
        "b200": 192,
    }[key]
    # nvidia-smi totals sit between the nominal size in GiB minus a reserve and the nominal GB.
    assert 0.9 * nominal_gb * 1e9 < gpu.memory_bytes <= nominal_gb * GiB
    assert catalog.lookup_gpu(key) == gpu
    assert catalog.lookup_gpu(gpu.product) == gpu  # GFD node label spelling
    assert catalog.gpu_key(gpu.product) == key
    # Llama-3-8B fits on every catalog GPU at 4k context.
    p = kv_plan.plan(
        kv_plan.PlanInput(model=catalog.MODELS["llama-3-8b"], gpu_memory_bytes=gpu.memory_bytes, max_model_len=4096)
    )
    assert p.fits, p.message
    assert p.kv_cache_bytes_per_gpu <= p.memory_budget_bytes_per_gpu - p.weight_bytes_per_gpu


def test_unknown_names():
    assert catalog.lookup_model("gpt-5") is None
    assert catalog.lookup_gpu("tpu-v5") is None
    assert catalog.gpu_key("tpu-v5") is None


def test_memory_arithmetic_never_overcommits():
    for key, m in catalog.MODELS.items():
        for t in kv_plan.valid_tensor_parallel_sizes(m):
            for gkey, gpu in catalog.GPUS.items():
                p = kv_plan.plan(
                    kv_plan.PlanInput(
                        model=m, gpu_memory_bytes=gpu.memory_bytes, tensor_parallel_size=t, max_model_len=2048
                    )
                )
                used = p.weight_bytes_per_gpu + p.activation_reserve_bytes + p.runtime_overhead_bytes
                assert p.kv_cache_bytes_per_gpu + (used if p.fits else 0) <= p.memory_budget_bytes_per_gpu
                assert p.kv_cache_bytes_per_gpu % p.kv_bytes_per_block_per_gpu == 0
                if p.num_kv_cache_groups == 1:
                    assert p.kv_bytes_per_block_per_gpu == p.block_size * p.kv_bytes_per_token_per_gpu
                assert p.fits == (p.max_concurrency >= 1 and p.reason == "Fits"), (key, t, gkey)
    assert MiB * 1024 == GiB

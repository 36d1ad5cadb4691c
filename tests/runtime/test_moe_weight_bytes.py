"""The planner's weight bytes per rank (capacity.weight_bytes_per_rank) equal what the runtime allocates for
the MoE and Qwen3 families, at full size (the model built on the meta device: real shapes, no memory), in
bfloat16 and fp8, for t = 1, 2, 4, 8; an fp8 MoE model really holds 1-byte experts, and they compute what
the 16-bit experts do within FP8's rounding. (Greedy closeness to bfloat16 is not asserted on these
random-weight models: their logits are too flat, as tests/runtime/test_fp8_weights.py notes for Llama.)"""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.runtime import LLM, SamplingParams, capacity
from kvserve.runtime.config import load_model_config
from kvserve.runtime.models.attention_backends import get_attention_backend
from kvserve.runtime.models.loader import build_meta_model, weight_bytes
from kvserve.runtime.models.parallel_layers import ParallelContext

# Published shapes (size fields of the public config.json files).
SHAPES = {
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=32000,
        rms_norm_eps=1e-5,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        vocab_size=151936,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
    ),
    # A Qwen3-MoE shape whose some layers keep a dense MLP of another width (mlp_only_layers, decoder_sparse_step).
    "qwen3-moe-dense-layers": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=512,
        intermediate_size=1536,
        moe_intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        vocab_size=1000,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
    ),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_runtime_weight_bytes_per_rank_equal_the_planners(tmp_path, name, dtype):
    (tmp_path / "config.json").write_text(json.dumps(dict(SHAPES[name], dtype="bfloat16")))
    mc = load_model_config(str(tmp_path), dtype=dtype, max_model_len=16)
    for t in (1, 2, 4, 8):
        model = build_meta_model(mc, get_attention_backend("torch"), ParallelContext(0, t))
        assert weight_bytes(model) == capacity.weight_bytes_per_rank(mc.shape, dtype, t), (name, dtype, t)


@pytest.mark.parametrize("path", ["dequant", "scaled_mm"])
def test_fp8_experts_match_the_16_bit_experts_within_fp8_rounding(path, monkeypatch):
    """Same routing, same weights: the fp8 experts' output (each expert's rows quantised with their own
    scales, as the loader does) is within FP8's rounding of the bfloat16 experts'."""
    from kvserve.runtime.models import fp8
    from kvserve.runtime.models.moe import Experts, convert_experts_to_fp8, route

    monkeypatch.setenv("KVSERVE_FP8_MATMUL", path)
    torch.manual_seed(0)
    ref = Experts(num_experts=4, hidden=64, intermediate=32).to(torch.bfloat16)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.2)
    quant = Experts(num_experts=4, hidden=64, intermediate=32).to(torch.bfloat16)
    convert_experts_to_fp8(quant)
    for name in ("gate_up_proj", "down_proj"):
        q, scale = fp8.quantize_rows(getattr(ref, name).detach())
        getattr(quant, name).data.copy_(q)
        getattr(quant, f"{name}_scale").copy_(scale)
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    weights, ids = route(torch.randn(40, 4, dtype=torch.bfloat16), 2, True, True)
    want, got = ref(x, ids, weights).float(), quant(x, ids, weights).float()
    assert ((got - want).norm() / want.norm()) < (0.05 if path == "dequant" else 0.08)


def test_fp8_moe_model_holds_one_byte_experts(model_factory):
    model_dir, _ = model_factory("mixtral_moe")
    llm = LLM(model_dir, dtype="fp8", max_model_len=64, num_kv_blocks=64)
    model = llm.engine.executor.runner.model
    experts = model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.float8_e4m3fn
    assert model.layers[0].mlp.gate.weight.dtype == torch.bfloat16  # the router stays 16-bit
    assert weight_bytes(model) == capacity.weight_bytes_per_rank(llm.engine.config.model.shape, "fp8", 1)
    out = llm.generate(
        [{"prompt_token_ids": [5, 6, 7, 8]}],
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(out[0].outputs[0].token_ids) == 4

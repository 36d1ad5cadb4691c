"""How an HF config.json (as a dict) maps onto a ModelShape, as transformers reads it."""

from __future__ import annotations

from kvserve.runtime.capacity.shape import ModelShape
from kvserve.runtime.capacity.support import GEMMA_ARCHITECTURES, SUPPORTED_ARCHITECTURES
from kvserve.runtime.capacity.weights import parameters_per_rank


def shape_from_hf_config(config: dict) -> ModelShape:
    """An HF config.json (as a dict) -> ModelShape. num_parameters is computed (no safetensors index read)."""
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), archs[0] if archs else "")
    text = config.get("text_config") or config  # multimodal wrappers keep the decoder's fields here
    gemma = arch in GEMMA_ARCHITECTURES
    layer_types = gemma_layer_types(text) if gemma else ()
    num_sliding = sum(t == "sliding_attention" for t in layer_types)
    heads = int(text["num_attention_heads"])
    hidden = int(text["hidden_size"])
    num_experts = int(text.get("num_local_experts") or text.get("num_experts") or 0)
    inter = (
        int(text.get("moe_intermediate_size") or text["intermediate_size"])
        if num_experts
        else int(text["intermediate_size"])
    )
    shape = ModelShape(
        num_layers=int(text["num_hidden_layers"]),
        num_attention_heads=heads,
        num_kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or hidden // heads),
        hidden_size=hidden,
        num_parameters=0,
        max_position_embeddings=int(text.get("max_position_embeddings") or 4096),
        intermediate_size=inter,
        vocab_size=int(text["vocab_size"]),
        experts_per_token=int(text.get("num_experts_per_tok") or 1) if num_experts else 1,
        num_experts=num_experts,
        architecture=arch,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", gemma))),
        attention_bias=arch == "Qwen2ForCausalLM" or bool(text.get("attention_bias", False)),
        o_proj_bias=arch != "Qwen2ForCausalLM" and bool(text.get("attention_bias", False)),
        mlp_bias=bool(text.get("mlp_bias", False)),
        qk_norm=arch.startswith("Qwen3") or arch == "Gemma3ForCausalLM",
        sliding_window=int(text.get("sliding_window") or 0) if num_sliding else 0,
        num_sliding_layers=num_sliding if text.get("sliding_window") else 0,
        num_layer_norms=4 if gemma else 2,
        num_dense_layers=_num_dense_layers(text, num_experts) if num_experts else 0,
        dense_intermediate_size=int(text["intermediate_size"]) if num_experts else 0,
    )
    return ModelShape(**{**shape.__dict__, "num_parameters": parameters_per_rank(shape, 1)})


def gemma_layer_types(text: dict) -> tuple[str, ...]:
    """ "sliding_attention" / "full_attention" per layer, as transformers decides: an explicit layer_types,
    else Gemma 2 slides on even indices (1:1) and Gemma 3 on all but every sliding_window_pattern-th (5:1)."""
    num_layers = int(text["num_hidden_layers"])
    explicit = text.get("layer_types")
    if explicit:
        return tuple(explicit)
    pattern = 2 if text.get("model_type") == "gemma2" else int(text.get("sliding_window_pattern") or 6)
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))


def _num_dense_layers(text: dict, num_experts: int) -> int:
    """transformers' Qwen3-MoE rule (runtime/models/registry.py's moe_shape applies the same): layer i is
    sparse unless listed in mlp_only_layers, and only every decoder_sparse_step-th layer (from 1) is."""
    mlp_only = set(text.get("mlp_only_layers") or [])
    step = int(text.get("decoder_sparse_step") or 1)
    layers = int(text["num_hidden_layers"])
    return sum(1 for i in range(layers) if i in mlp_only or not (num_experts > 0 and (i + 1) % step == 0))

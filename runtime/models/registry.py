"""Which architectures the runtime serves, which class implements each, and the MoE facts read from a
config. Torch-free: the engine's config validation and the tensor-parallel shape rules use it before any
model is built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

# config.json "architectures" entry -> (module under kvserve.runtime.models, class name)
MODEL_CLASSES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    # Mixtral = Llama with every MLP a SparseMoeBlock (moe_shape below decides which layers are sparse).
    "MixtralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("llama", "Qwen3ForCausalLM"),
    # Sliding-window / global layers, soft-capping, sandwich norms (gemma.py).
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
}


def model_class(architecture: str) -> type:
    module, name = MODEL_CLASSES[architecture]
    return getattr(importlib.import_module(f"kvserve.runtime.models.{module}"), name)


@dataclass(frozen=True)
class MoEShape:
    """A sparse MLP's routing and width, as transformers computes it for the family."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert, whole (tensor parallelism splits it like a dense MLP's)
    intermediate_field: str  # the config field it comes from (named in errors)
    renormalize: bool  # divide the top-k probabilities by their sum
    fp32_weights: bool  # Mixtral keeps the routing weights in fp32; Qwen3-MoE casts them to the model dtype
    sparse_layers: frozenset[int]  # layer indices whose MLP is the MoE block (the rest are dense)


def moe_shape(hf_config: Any) -> MoEShape | None:
    """The MoE block of a Mixtral / Qwen3-MoE config, None for a dense model."""
    arch = next((a for a in getattr(hf_config, "architectures", None) or [] if a in MODEL_CLASSES), "")
    layers = range(hf_config.num_hidden_layers)
    if arch == "MixtralForCausalLM":
        return MoEShape(
            num_experts=hf_config.num_local_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.intermediate_size,
            intermediate_field="intermediate_size",
            renormalize=True,
            fp32_weights=True,
            sparse_layers=frozenset(layers),
        )
    if arch == "Qwen3MoeForCausalLM":
        # transformers: layer i is sparse unless listed in mlp_only_layers, and only every
        # decoder_sparse_step-th layer (counting from 1) is.
        mlp_only = set(getattr(hf_config, "mlp_only_layers", None) or [])
        step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
        num_experts = int(hf_config.num_experts)
        sparse = frozenset(i for i in layers if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0)
        return MoEShape(
            num_experts=num_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.moe_intermediate_size,
            intermediate_field="moe_intermediate_size",
            renormalize=bool(getattr(hf_config, "norm_topk_prob", False)),
            fp32_weights=False,
            sparse_layers=sparse,
        )
    return None


def split_widths(hf_config: Any) -> dict[str, int]:
    """The FFN widths tensor parallelism splits, by config field: the dense MLP's intermediate_size when some
    layer is dense, and the experts' width when some layer is sparse."""
    moe = moe_shape(hf_config)
    widths: dict[str, int] = {}
    if moe is None or len(moe.sparse_layers) < hf_config.num_hidden_layers:
        widths["intermediate_size"] = hf_config.intermediate_size
    if moe is not None and moe.sparse_layers:
        widths[moe.intermediate_field] = moe.intermediate_size
    return widths

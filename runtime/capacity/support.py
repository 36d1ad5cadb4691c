"""Which models the runtime serves: the architectures its model files implement, which of them a pipeline
stage can be cut from, and why a config.json is refused (architecture, RoPE type); the context limit and
checkpoint dtype it serves one with (runtime.engine_args.resolve_for_config: serve and plan)."""

from __future__ import annotations

from kvserve.runtime.capacity.shape import ModelShape

# What the runtime's model files implement (runtime/models). The planner refuses anything else.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)  # classes: runtime/models/registry.py
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")

# Architectures whose model class has the Llama layout a pipeline stage is cut from (models/pipeline_stage.py);
# the runtime refuses PP for others (config.py) and the operator never renders a group for them;
# Gemma's sandwich norms and per-layer KV cache groups are not staged yet.
PIPELINE_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
)

UNSUPPORTED_ROPE_TYPES = ("dynamic", "longrope")  # frequencies change with the running length; one table here


def checkpoint_dtype(config: dict) -> str:
    """What `--dtype auto` loads: the dtype config.json declares (`dtype`; `torch_dtype` in files written
    before transformers 4.56), else float32, transformers' default. As written (weight_dtype canonicalises)."""
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


def _config_architecture(config: dict) -> str:
    archs = config.get("architectures") or []
    return next((a for a in archs if a in SUPPORTED_ARCHITECTURES), "")


def context_limit(config: dict) -> int:
    """The longest max_model_len the runtime serves for this config.json (and its default): the decoder's
    max_position_embeddings (4096 when absent, as shape_from_hf_config), capped at the sliding window for
    models other than Gemma: only Gemma's models implement sliding-window layers (runtime/models/gemma.py),
    the others keep every sequence inside the window, where full attention is exact. use_sliding_window
    defaults as transformers' configs do (False for the Qwen families, which carry the flag)."""
    text = config.get("text_config") or config
    arch = _config_architecture(config)
    limit = int(text.get("max_position_embeddings") or 0) or 4096
    window = text.get("sliding_window")
    if window and text.get("use_sliding_window", not arch.startswith("Qwen")) and arch not in GEMMA_ARCHITECTURES:
        limit = min(limit, int(window))
    return limit


def unsupported_config_error(config: dict, source: str = "config.json") -> str | None:
    """Why the runtime refuses this config.json (its architecture or RoPE type), or None. `source` names the
    file in the message."""
    archs = config.get("architectures") or []
    if not _config_architecture(config):
        return (
            f"unsupported architecture {archs or config.get('model_type')!r} in {source}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    text = config.get("text_config") or config
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in UNSUPPORTED_ROPE_TYPES:
        return f"rope_type {rope_type!r} in {source} is not supported (supported: default, linear, llama3, yarn)"
    return None


def unsupported_architecture_error(shape: ModelShape) -> str | None:
    if shape.architecture in SUPPORTED_ARCHITECTURES:
        return None
    return (
        f"architecture {shape.architecture or 'unknown'!r} is not served by the kvserve runtime; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )

"""Random-weight Hugging Face model directories built offline from a config (the demo model, benchmarks, tests).

transformers instantiates the architecture from the config, so the checkpoint has exactly the names and
layout a real download would; a word-level tokenizer ("w<id>" words) makes every id decodable.
"""

from __future__ import annotations

import os

ARCH_CONFIGS = {
    "LlamaForCausalLM": "LlamaConfig",
    "MistralForCausalLM": "MistralConfig",
    "Qwen2ForCausalLM": "Qwen2Config",
    "MixtralForCausalLM": "MixtralConfig",
    "Qwen3ForCausalLM": "Qwen3Config",
    "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
    "Gemma2ForCausalLM": "Gemma2Config",
    "Gemma3ForCausalLM": "Gemma3TextConfig",
}


def make_shape_dir(
    out_dir: str, architecture: str = "LlamaForCausalLM", dtype: str = "bfloat16", **config_kwargs
) -> str:
    """config.json + tokenizer, no weights: a model shape for load_format="dummy" (benchmarks of an 8B or 70B
    shape without writing its checkpoint). Returns out_dir."""
    import transformers

    config_kwargs.setdefault("bos_token_id", 1)
    config_kwargs.setdefault("eos_token_id", 2)
    config = getattr(transformers, ARCH_CONFIGS[architecture])(
        **config_kwargs, torch_dtype=dtype, architectures=[architecture]
    )
    os.makedirs(out_dir, exist_ok=True)
    config.save_pretrained(out_dir)
    write_word_tokenizer(out_dir, config.vocab_size)
    return out_dir


def make_random_model_dir(
    out_dir: str,
    architecture: str = "LlamaForCausalLM",
    seed: int = 0,
    dtype: str = "float32",
    norm_weight_std: float = 0.0,
    **config_kwargs,
):
    """Write config.json + model.safetensors + tokenizer files to out_dir; returns the HF model (eval).
    norm_weight_std > 0 draws every RMSNorm weight (transformers initialises them to ones) from
    1 + N(0, std), so a norm weight that is loaded into the wrong place or not applied changes the output."""
    import torch
    import transformers

    config_kwargs.setdefault("bos_token_id", 1)
    config_kwargs.setdefault("eos_token_id", 2)
    config = getattr(transformers, ARCH_CONFIGS[architecture])(**config_kwargs)
    torch.manual_seed(seed)
    if architecture.startswith("Gemma"):
        config._attn_implementation = "eager"  # the reference path: SDPA cannot softcap
    model = getattr(transformers, architecture)(config).eval()
    if norm_weight_std:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(1 + norm_weight_std * torch.randn_like(param))
    model.to(getattr(torch, dtype))
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    write_word_tokenizer(out_dir, config.vocab_size)
    return model


def write_word_tokenizer(out_dir: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out_dir)


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_random_adapter_dir(model_dir: str, out_dir: str, rank: int, seed: int = 0, scale: float = 0.1) -> str:
    """A random LoRA adapter in PEFT's format (adapter_config.json + adapter_model.safetensors) for a dense
    Llama-shaped model dir, on all seven targets, without peft or transformers: A and B ~ N(0, scale^2) (B
    non-zero, so the adapter changes the tokens), lora_alpha = 2 x rank. Returns out_dir."""
    import json

    import torch
    from safetensors.torch import save_file

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}  # (in, out) features
    shapes |= {"gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (d_in, d_out) in shapes.items():
            part = "self_attn" if module in LORA_TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) * scale
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * scale
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    config = {"r": rank, "lora_alpha": 2 * rank, "target_modules": list(LORA_TARGETS), "peft_type": "LORA"}
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return out_dir

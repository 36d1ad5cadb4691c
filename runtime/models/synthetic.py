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

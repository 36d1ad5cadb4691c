"""A GGUF file's header as the Hugging Face config.json the runtime and the planner read.

GGUF (llama.cpp's single-file checkpoint) carries the model's hyperparameters as `{arch}.*` metadata keys,
the tokenizer as `tokenizer.ggml.*`, and the tensors with their quant types; the `gguf` package (gguf-py,
maintained in llama.cpp's repository) parses it. This module reads the header only (the tensor data stays
memory-mapped and untouched), so `kvserve plan --model-config MODEL.gguf` costs milliseconds. No torch:
numpy comes with gguf.

Architectures: llama (also Mistral and SmolLM, which llama.cpp files as llama), qwen2 and qwen3: the dense
families runtime/models/llama.py serves. The key names follow gguf-py's `Keys` and transformers'
GGUF_TO_TRANSFORMERS_MAPPING, which the tests use as the reference.
"""

from __future__ import annotations

import os
from typing import Any

from kvserve.runtime.errors import InvalidParameter

# GGUF general.architecture -> (HF architecture, HF model_type)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
# Tensor types the loader dequantises (gguf.quants implements them; the list plus their close kin).
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K")
SUPPORTED_TENSOR_TYPES += ("Q5_K", "Q6_K")
# general.file_type values (llama.cpp's LLAMA_FTYPE) that mean unquantised 16-bit weights
_FILE_TYPE_DTYPE = {0: "float32", 1: "float16", 32: "bfloat16"}


def is_gguf_path(model: str) -> bool:
    return str(model).lower().endswith(".gguf")


def open_reader(path: str, field: str = "model"):
    """gguf.GGUFReader for `path`; InvalidParameter(field) when the file is missing or not GGUF."""
    if not os.path.isfile(path):
        raise InvalidParameter(field, f"GGUF file {path!r} does not exist")
    try:
        from gguf import GGUFReader
    except ImportError:
        raise InvalidParameter(
            field, f"{path}: reading GGUF files needs the `gguf` package (pip install gguf)"
        ) from None
    try:
        return GGUFReader(path, "r")
    except Exception as exc:  # noqa: BLE001 -- gguf raises ValueError, struct errors, ...: name the file instead
        raise InvalidParameter(field, f"{path} is not a readable GGUF file: {exc}") from exc


def metadata(reader) -> dict[str, Any]:
    """Every scalar or string-array metadata key -> its value (the long tokenizer arrays are left out)."""
    out: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if key in (
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.merges",
            "tokenizer.ggml.token_type",
            "tokenizer.ggml.scores",
        ):
            continue
        try:
            out[key] = f.contents()
        except Exception:  # noqa: BLE001 -- a key type this gguf version cannot decode: not one we read
            continue
    return out


def architecture(meta: dict[str, Any], path: str) -> str:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise InvalidParameter(
            "model",
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}",
        )
    return arch


def check_tensor_types(reader, path: str) -> None:
    """InvalidParameter naming the first tensor whose quant type kvserve does not dequantise."""
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
            raise InvalidParameter(
                "model",
                f"{path}: tensor {t.name} has GGUF type {t.tensor_type.name}, which kvserve does not dequantise; "
                f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}",
            )


def hf_config(path: str, reader=None) -> dict[str, Any]:
    """The config.json (a dict) transformers would derive from this GGUF file. InvalidParameter("model") for
    an architecture, RoPE scaling or tensor type the runtime cannot serve."""
    reader = reader if reader is not None else open_reader(path)
    meta = metadata(reader)
    arch = architecture(meta, path)
    check_tensor_types(reader, path)
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:  # Llama 3.1's RoPE scaling, stored by llama.cpp as frequency factors
        raise InvalidParameter("model", f"{path}: GGUF rope_freqs (Llama 3.1 RoPE scaling) is not supported")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise InvalidParameter("model", f"{path}: GGUF RoPE scaling {scaling!r} is not supported")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise InvalidParameter("model", f"{path}: GGUF metadata key {arch}.{name} is missing")
        return value

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    vocab = meta.get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    hf_arch, model_type = ARCHITECTURES[arch]
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": False,
        "torch_dtype": _FILE_TYPE_DTYPE.get(int(meta.get("general.file_type", -1)), "float32"),
    }
    if model_type == "qwen2":
        config.pop("attention_bias")  # Qwen2's q/k/v bias is implied by the architecture
    for name, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        if gguf_key in meta:
            config[name] = int(meta[gguf_key])
    return config

"""Small GGUF files for the tests, written with gguf-py's GGUFWriter as llama.cpp's convert_hf_to_gguf.py would
write them: llama metadata keys, `blk.N.*` tensor names, q/k rows permuted for llama.cpp's RoPE, the tokenizer
as `tokenizer.ggml.*` (a byte-level BPE: tokens, merges, token types) with a chat template.

Quantised tensors: gguf-py quantises F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1; it has no K-quant
quantiser, so Q4_K and Q6_K tensors are random blocks (random codes and sub-block scales, small fp16 super-block
scales): valid files whose weights are whatever those blocks decode to, which is all a loader test needs.
"""

from __future__ import annotations

import json
import os

import numpy as np

K_QUANT_BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210}  # per 256 weights (ggml's block_q4_K / block_q6_K)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (HF's half-split RoPE rows -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_k_quant_blocks(rows: int, cols: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    nbytes = K_QUANT_BLOCK_BYTES[kind]
    blocks = rng.integers(0, 256, size=(rows * cols // 256, nbytes), dtype=np.uint8)
    # Scales chosen for mean-0 weights of std ~0.2 (peaked logits: clear greedy winners).
    if kind == "Q4_K":  # d, dmin (fp16) first: value = d * scale * q - dmin * min; scale, min 0..63, q 0..15
        blocks[:, 0:2] = np.frombuffer(np.float16(2e-3).tobytes(), np.uint8)
        blocks[:, 2:4] = np.frombuffer(np.float16(1.5e-2).tobytes(), np.uint8)  # E[d*s*q] = E[dmin*m]
    else:  # Q6_K: ql, qh, int8 scales, d (fp16) last: value = d * scale * (q - 32)
        blocks[:, -2:] = np.frombuffer(np.float16(1.5e-4).tobytes(), np.uint8)
    return blocks.reshape(rows, cols // 256 * nbytes)


def write_gguf(model_dir: str, out_path: str, tensor_type: str = "F32", seed: int = 0) -> str:
    """Write the HF llama checkpoint in `model_dir` (config.json, model.safetensors, tokenizer.json with a
    byte-level BPE) as a GGUF file; 2-D weights in `tensor_type`, norms in F32 (as llama.cpp keeps them)."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from safetensors.numpy import load_file

    config = json.load(open(os.path.join(model_dir, "config.json")))
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    rng = np.random.default_rng(seed)

    w = gguf.GGUFWriter(out_path, "llama")
    w.add_name("kvserve-test-random")
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    w.add_rope_dimension_count(config["hidden_size"] // heads)
    _add_tokenizer(w, model_dir)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if "lm_head.weight" in tensors and not config.get("tie_word_embeddings"):
        names["lm_head.weight"] = "output.weight"
    block = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(config["num_hidden_layers"]):
        for hf, gg in block.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    for hf, gg in names.items():
        x = tensors[hf].astype(np.float32)
        if gg.endswith("attn_q.weight"):
            x = _permute(x, heads)
        elif gg.endswith("attn_k.weight"):
            x = _permute(x, kv_heads)
        if x.ndim == 1 or tensor_type == "F32":
            w.add_tensor(gg, x)
        elif tensor_type in K_QUANT_BLOCK_BYTES:
            w.add_tensor(gg, _random_k_quant_blocks(*x.shape, tensor_type, rng), raw_dtype=T[tensor_type])
        elif tensor_type == "F16":
            w.add_tensor(gg, x.astype(np.float16))
        else:
            w.add_tensor(gg, gguf.quants.quantize(x, T[tensor_type]), raw_dtype=T[tensor_type])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


def _add_tokenizer(w, model_dir: str) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp's "gpt2" tokenizer model."""
    tok = json.load(open(os.path.join(model_dir, "tokenizer.json")))
    vocab = tok["model"]["vocab"]
    special = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    tokens = [None] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special.values() else 1 for i in range(len(tokens))])  # 3: control
    w.add_token_merges(merges)
    cfg = json.load(open(os.path.join(model_dir, "tokenizer_config.json")))
    ids = {name: special.get(cfg.get(name)) for name in ("bos_token", "eos_token", "pad_token")}
    if ids["bos_token"] is not None:
        w.add_bos_token_id(ids["bos_token"])
    w.add_eos_token_id(ids["eos_token"])
    if ids["pad_token"] is not None:
        w.add_pad_token_id(ids["pad_token"])
    w.add_add_bos_token(False)
    w.add_chat_template(cfg["chat_template"])


def random_llama_dir(d, **shape) -> str:
    """A random-weight Llama folder at `d` with the demo model's byte-level BPE tokenizer (what a GGUF carries):
    GQA 4/2, 2 layers, tied embeddings; `shape` overrides the config (hidden_size, head_dim, ...)."""
    import glob

    from kvserve.runtime import demo_model
    from kvserve.runtime.models.synthetic import make_random_model_dir

    vocab = demo_model._build_tokenizer(d)
    config = dict(
        seed=0,
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    make_random_model_dir(str(d), "LlamaForCausalLM", **{**config, **shape})
    for f in {*glob.glob(f"{d}/*token*"), *glob.glob(f"{d}/special*")}:  # the word tokenizer it wrote
        os.remove(f)
    demo_model._build_tokenizer(d)
    return str(d)

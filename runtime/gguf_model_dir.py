"""`LLM("MODEL.gguf")` and `kvserve serve MODEL.gguf`: a GGUF file served through the model-directory path.

Everything in kvserve that knows a model reads a directory (config.json for the engine, the planner and the
API server; the tokenizer files for the front end). For a GGUF file, `prepare` writes that directory once,
small and without weights, into the kvserve cache ($KVSERVE_CACHE_DIR, default ~/.cache/kvserve, under
gguf/):
- config.json from the GGUF header (runtime/gguf_config.py);
- the tokenizer and its chat template from the file's `tokenizer.ggml.*` metadata, converted by transformers
  (the conversion `AutoTokenizer.from_pretrained(dir, gguf_file=...)` does), or copied from `tokenizer`
  (vLLM's --tokenizer) when one is given;
- kvserve-gguf.json, naming the GGUF file, its size and mtime: the loader (runtime/models/loader.py) then
  reads and dequantises the weights from the GGUF file itself at every start, to the serving dtype
  (runtime/models/gguf_weights.py). No dequantised copy is stored: it would be 4-8x the file.
The directory's name hashes the file's path, size and mtime and the tokenizer source, so an edited file or
another tokenizer gets a fresh directory; it appears by an atomic rename, so concurrent starts are safe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from kvserve.runtime import gguf_config
from kvserve.runtime.errors import InvalidParameter

logger = logging.getLogger("kvserve.gguf")

FORMAT_VERSION = 1  # bump when the files written below change
POINTER = "kvserve-gguf.json"
is_gguf_path = gguf_config.is_gguf_path


def _cache_root(cache_dir: str | Path | None) -> Path:
    from kvserve.runtime.demo_model import default_cache_dir

    return Path(cache_dir) if cache_dir is not None else default_cache_dir()


def _identity(path: str) -> dict:
    st = os.stat(path)
    return {"gguf": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def prepared_dir(path: str, tokenizer: str | None = None, cache_dir: str | Path | None = None) -> Path:
    """Where `prepare` puts (or has put) the directory for this file and tokenizer source."""
    path = os.path.abspath(path)
    spec = {"v": FORMAT_VERSION, **_identity(path), "tokenizer": os.path.abspath(tokenizer) if tokenizer else None}
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    stem = Path(path).name[: -len(".gguf")]
    return _cache_root(cache_dir) / "gguf" / f"{stem}-{digest}"


def prepare(path: str, tokenizer: str | None = None, cache_dir: str | Path | None = None) -> str:
    """The model directory for GGUF file `path` (written on first use). InvalidParameter("model") for a file
    the runtime cannot serve, InvalidParameter("tokenizer") for a tokenizer that does not load."""
    if not os.path.isfile(path):
        raise InvalidParameter("model", f"GGUF file {path!r} does not exist")
    path = os.path.abspath(path)
    target = prepared_dir(path, tokenizer, cache_dir)
    if (target / "config.json").exists():
        return str(target)
    config = gguf_config.hf_config(path)  # refuses unsupported architectures and quant types before any work
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gguf-prepare-", dir=target.parent))
    os.chmod(tmp, 0o755)
    try:
        _write_tokenizer(path, tokenizer, tmp)
        (tmp / POINTER).write_text(json.dumps(_identity(path), indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))  # last: its presence marks completion
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():  # a concurrent start won unless it failed too
                raise
        logger.info("prepared %s for %s (config, tokenizer; weights stay in the GGUF file)", target, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def _write_tokenizer(path: str, tokenizer: str | None, out: Path) -> None:
    from transformers import AutoTokenizer

    try:
        if tokenizer:
            tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
        else:
            tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    except Exception as exc:  # noqa: BLE001 -- transformers raises many types; name the field instead
        field, source = ("tokenizer", tokenizer) if tokenizer else ("model", f"{path}'s tokenizer.ggml metadata")
        raise InvalidParameter(field, f"cannot load a tokenizer from {source}: {exc}") from exc
    tok.save_pretrained(str(out))


def gguf_file(model_dir: str) -> str | None:
    """The GGUF file a prepared directory stands for (None for an ordinary model directory). Raises
    InvalidParameter("model") when that file changed or vanished since the directory was written."""
    pointer = Path(model_dir) / POINTER
    if not pointer.is_file():
        return None
    recorded = json.loads(pointer.read_text())
    path = recorded["gguf"]
    if not os.path.isfile(path) or _identity(path) != recorded:
        raise InvalidParameter(
            "model", f"{model_dir} was prepared from {path}, which has changed or is gone; serve the .gguf file again"
        )
    return path


def resolve(model: str, tokenizer: str | None = None) -> str:
    """The model directory to load for `model` (a directory, or a .gguf file, which gets prepared). A
    tokenizer other than the model's own is only taken for GGUF files (a directory carries its own)."""
    if is_gguf_path(model):
        return prepare(model, tokenizer)
    if tokenizer:
        raise InvalidParameter(
            "tokenizer", "tokenizer is supported for GGUF models only (a model directory carries its own tokenizer)"
        )
    return model

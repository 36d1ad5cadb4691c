"""Weights at disk speed (issue 43, scope 2): the model's weight load (runtime/models/loader.load_model: build on
the meta device, allocate once, fill from the checkpoint) against a plain sequential read of the same files
(`cat FILES > /dev/null`), as GB/s and their ratio.

    .venv/bin/python tools/measure_weight_load.py MODEL_DIR_OR_GGUF [--runs 3] [--dtype auto]

Both are measured with the files in the page cache (each is run once first and not counted): what a restart
on the same node sees, and the only condition a shared machine can reproduce (dropping the page cache would
disturb everyone). Prints the median of --runs of each. A GGUF file is dequantised as it loads (CPU work, not
disk): its ratio says how far from the read speed that leaves the load. torch's intra-op threads are set as the
engine-core process sets them (core_process.core_cpu_threads: all cores but one): on a shared machine a copy_
over every core waits at OpenMP barriers for descheduled threads (measured here: 15x slower with 2 of 2 cores).
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import subprocess
import sys
import time


def files_of(model_dir: str) -> list[str]:
    from kvserve.runtime import gguf_model_dir

    gguf = gguf_model_dir.gguf_file(model_dir)
    return [gguf] if gguf is not None else sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))


def cat_s(files: list[str]) -> float:
    started = time.monotonic()
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    return time.monotonic() - started


def load_s(model_dir: str, dtype: str) -> float:

    from kvserve.runtime.config import load_model_config
    from kvserve.runtime.models.attention_backends import get_attention_backend
    from kvserve.runtime.models.loader import load_model

    config = load_model_config(model_dir, dtype)
    backend = get_attention_backend("torch")
    started = time.monotonic()
    model = load_model(config, backend, "cpu", load_format="auto")
    seconds = time.monotonic() - started
    del model
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="HF model directory (*.safetensors) or MODEL.gguf")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    import torch

    from kvserve.runtime import gguf_model_dir
    from kvserve.runtime.engine.core_process import core_cpu_threads

    threads = core_cpu_threads(None)
    if threads is not None:
        torch.set_num_threads(threads)
    model_dir = gguf_model_dir.resolve(args.model, None)
    files = files_of(model_dir)
    size = sum(os.path.getsize(f) for f in files)
    cat_s(files)
    load_s(model_dir, args.dtype)  # warm: page cache, imports, first allocations
    cats = [cat_s(files) for _ in range(args.runs)]
    loads = [load_s(model_dir, args.dtype) for _ in range(args.runs)]
    cat, load = statistics.median(cats), statistics.median(loads)
    print(
        f"{len(files)} file(s), {size / 1e9:.3f} GB; {torch.get_num_threads()} intra-op thread(s); "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"cat > /dev/null  {cat:6.2f} s  {size / cat / 1e9:6.2f} GB/s   (runs: {', '.join(f'{s:.2f}' for s in cats)})"
    )
    runs = ", ".join(f"{s:.2f}" for s in loads)
    print(f"load_model       {load:6.2f} s  {size / load / 1e9:6.2f} GB/s   (runs: {runs})")
    print(f"load / read speed ratio: {cat / load:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

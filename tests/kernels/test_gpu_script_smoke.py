"""runtime/bench/gpu_kernels.py --cpu-smoke: the GPU script's code paths at tiny sizes under the interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "runtime", "bench", "gpu_kernels.py")


def test_gpu_script_cpu_smoke(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "results.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, SCRIPT, "--cpu-smoke", "--out", str(out)], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["mode"] == "cpu-smoke"
    kernels = {c["kernel"] for c in data["checks"]}
    assert kernels == {
        "store_kv_cache",
        "paged_attention[mixed,2d]",
        "paged_attention[decode,split-k]",
        "paged_attention[decode,2d]",
    }
    assert all(c["ok"] for c in data["checks"])
    assert {c["cache_dtype"] for c in data["checks"]} >= {"float8_e4m3fn", "float8_e5m2"}
    assert data["copy_GBps"] > 0 and data["decode_grid"] and all("triton_ms" in r for r in data["decode_grid"])
    e2e = data["e2e"]
    assert "error" not in e2e, e2e
    assert e2e["triton"]["decode_tokens_per_s"] > 0 and e2e["torch"]["decode_tokens_per_s"] > 0
    assert e2e["identical_sequences"] == f"{e2e['batch']}/{e2e['batch']}"  # fp32 tiny model: exact agreement
    assert "device" in res.stdout and "end to end" in res.stdout

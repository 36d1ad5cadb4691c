"""runtime/bench/gpu_serving.py --cpu-smoke: every section of the GPU serving script at tiny sizes on CPU (graphs
emulated, Triton interpreter), so the script a GPU session runs is known to work before device time is spent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "runtime", "bench", "gpu_serving.py")


def test_gpu_serving_script_cpu_smoke(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "results.json"
    res = subprocess.run(
        [sys.executable, SCRIPT, "--cpu-smoke", "--out", str(out)],
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["mode"] == "cpu-smoke"
    graphs = data["graphs"]
    assert graphs["ok"] and graphs["identical_sequences"] == "5/5" and graphs["graphs"]["replays"] > 0, graphs
    step = data["step"]
    assert [r["num_decodes"] for r in step["graphs"]] == [2] and all(r["model_ms"] > 0 for r in step["graphs"])
    served = data["served"]["eager"]
    assert served["returncode"] == 0 and served["served_over_offline"] > 0, served
    assert "identical sequences 5/5" in res.stdout and "served vs offline (eager)" in res.stdout

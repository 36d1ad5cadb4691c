"""Start-up phases (runtime/startup_phases.py): timed where they run, carried to the API server (the engine
core's in CoreReady), exported as kvserve:startup_phase_seconds{phase=...} and logged in one line."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.runtime.startup_phases import OVERLAPPED, describe, ordered, timed
from tests.server.conftest import LiveServer, make_engine
from tests.server.serve_process import GroupServer

pytestmark = pytest.mark.timeout(180)

RUNNER_PHASES = {"kernel_load", "weight_load", "memory_profile", "kv_cache_allocate"}


def scraped_phases(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "kvserve:startup_phase_seconds":
            return {s.labels["phase"]: s.value for s in family.samples}
    raise AssertionError("no kvserve:startup_phase_seconds in /metrics")


def test_timed_adds_only_completed_blocks_and_describe_orders_them():
    phases: dict[str, float] = {}
    with timed(phases, "weight_load"):
        time.sleep(0.02)
    with pytest.raises(ValueError), timed(phases, "kv_cache_allocate"):
        raise ValueError("a failed phase has no duration")
    with timed(phases, "model_resolve"):
        pass
    assert set(phases) == {"weight_load", "model_resolve"}
    assert phases["weight_load"] >= 0.02
    assert list(ordered({**phases, "total": 1.0, "custom": 0.5})) == ["model_resolve", "weight_load", "total", "custom"]
    assert re.fullmatch(r"model_resolve \d+\.\d\d s, weight_load 0\.0\d s", describe(phases)), describe(phases)


def test_in_process_engine_exports_the_runners_phases(demo_model_dir):
    srv = LiveServer(make_engine(demo_model_dir, in_process=True))
    try:
        phases = scraped_phases(srv.base_url)
    finally:
        srv.stop()
    assert RUNNER_PHASES | {"total"} <= set(phases), phases
    assert "engine_process_start" not in phases and "cuda_graph_capture" not in phases  # neither ran
    assert all(seconds >= 0 for seconds in phases.values())
    assert phases == pytest.approx(srv.state.startup_phases)


def test_kvserve_serve_exports_every_phase_and_logs_them(tmp_path):
    """The real command, engine core in its own process: the core's phases crossed in CoreReady, the phases
    timed in `kvserve serve` itself, and a total that covers them all."""
    server = GroupServer(str(tmp_path))
    try:
        phases = scraped_phases(server.base_url)
    finally:
        server.kill()
    expected = RUNNER_PHASES | {
        "model_resolve",
        "engine_config",
        "tokenizer_load",
        "engine_preload",
        "engine_process_start",
        "warmup",
        "total",
    }
    assert expected <= set(phases), phases
    assert phases["engine_preload"] > 0.05  # the prestarted core's interpreter imported torch
    assert phases["weight_load"] > 0
    assert phases["total"] >= sum(v for k, v in phases.items() if k != "total" and k not in OVERLAPPED)
    lines = [line for line in server.log if "start-up phases:" in line]
    assert len(lines) == 1, server.log
    for phase in expected:
        assert re.search(rf"\b{phase} \d+\.\d\d s", lines[0]), lines[0]
    ready = next(line for line in server.log if "ready: model=" in line)
    assert re.search(r"kv_blocks=(\d+) \((\d+) usable \+ 1 reserved null block\)", ready), ready


def test_serve_parses_its_flags_before_importing_the_server_or_torch():
    """`kvserve serve` prestarts the engine core right after parsing its flags, so the parse stays light: no
    server state (async engine, metrics), no torch, no transformers."""
    code = (
        "import sys\n"
        "from kvserve.cli.main import build_parser\n"
        "build_parser().parse_args(['serve'])\n"
        "heavy = {'torch', 'transformers', 'fastapi', 'uvicorn', 'kvserve.runtime.server.state'}\n"
        "print(sorted(heavy & (set(sys.modules) | {m.split('.')[0] for m in sys.modules})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

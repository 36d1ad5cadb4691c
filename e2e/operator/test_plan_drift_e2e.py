"""PlanDrift end to end (issue 44 scope 4): kopf with kvserve's handlers against kmock's KubernetesEmulator
(conftest.py, resync every 0.5 s). Two ready engine pods of an InferenceService with spec.slo, each with a
/metrics endpoint on its own loopback address (127.0.0.2, 127.0.0.3 at spec.port) exported by the engine's own
ServerMetrics: requests finish at a steady rate with the TPOT and TTFT the plan predicts for that load, times a
factor. On plan: PlanDrift stays False (WithinTolerance). One pod slowed 2x (what fewer threads than calibrated
does to every step): PlanDrift=True SlowerThanPlanned naming that pod within a few resyncs, one Warning Event,
and the drift-ratio gauge; the pod back on plan: PlanDrift clears."""

from __future__ import annotations

import copy
import http.server
import socket
import threading
import time
from typing import Any

import pytest
from kopf.testing import KopfRunner

from kvserve.operator import drift, labels, plan_drift
from kvserve.operator import metrics as operator_metrics
from kvserve.operator import spec as spec_mod
from kvserve.operator.plan_drift import DriftSettings, Measured
from kvserve.runtime.metrics import ServerMetrics

NS, NAME = "default", "chat"
RATE = 20.0  # finished requests per second per pod
PROMPT, OUTPUT = 512, 64
SETTINGS = DriftSettings(resyncs=3, min_requests=5)  # 0.5 s resyncs at 20 req/s: 10 requests a window
pytestmark = pytest.mark.timeout(120)

SPEC = {
    "model": {"uri": "pvc://models/llama-3-8b", "name": "llama-3-8b"},
    "gpu": {"product": "h100-80gb"},
    "slo": {"ttftP90Seconds": 1.0, "tpotP99Seconds": 0.05},
    "workload": {"requestRate": 100, "promptLen": PROMPT, "outputLen": OUTPUT},
}


class FakePod:
    """An engine pod's /metrics: at each scrape, the requests that finished since the last one at RATE, each with
    `factor` x the plan's predicted TTFT and TPOT at that load (the engine's own exposition, ServerMetrics)."""

    def __init__(self, host: str, port: int, ttft_s: float, tpot_s: float):
        self.metrics = ServerMetrics("llama-3-8b", 8192)
        self.ttft_s, self.tpot_s, self.factor = ttft_s, tpot_s, 1.0
        self.last, self.carry = time.monotonic(), 0.0
        self.lock = threading.Lock()
        pod = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = pod.scrape()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((host, port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def scrape(self) -> bytes:
        with self.lock:
            now = time.monotonic()
            due = (now - self.last) * RATE + self.carry
            self.last, n = now, int(due)
            self.carry = due - n
            ttft, tpot = self.ttft_s * self.factor, self.tpot_s * self.factor
            for _ in range(n):
                self.metrics.time_to_first_token.observe(ttft)
                self.metrics.observe_finished(
                    finish_reason="length",
                    num_prompt_tokens=PROMPT,
                    num_generation_tokens=OUTPUT,
                    arrival_time=0.0,
                    first_scheduled_time=0.0,
                    first_token_time=ttft,
                    finished_time=ttft + tpot * (OUTPUT - 1),
                )
            return self.metrics.render()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _free_port(hosts: tuple[str, ...]) -> int:
    """A port free on every one of `hosts` (loopback addresses: Linux routes all of 127/8 to lo)."""
    for _ in range(20):
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = s.getsockname()[1]
        try:
            for host in hosts:
                with socket.socket() as s:
                    s.bind((host, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on every loopback address")


def _pod(name: str, ip: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": labels.engine_labels(NAME)},
        "spec": {},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }


def _condition(emulator) -> dict:
    cr = emulator.get(emulator.CR, NS, NAME) or {}
    return next((c for c in (cr.get("status") or {}).get("conditions") or [] if c["type"] == "PlanDrift"), {})


def _warnings(emulator, reason: str) -> list[dict]:
    return [
        r.data
        for r in emulator.requests()
        if r.method == "POST"
        and r.resource is not None
        and r.resource.plural == "events"
        and (r.data or {}).get("reason") == reason
    ]


def _ratio(pod: str, metric: str) -> float | None:
    return operator_metrics.REGISTRY.get_sample_value(
        "kvserve_inferenceservice_plan_drift_ratio",
        {"namespace": NS, "inferenceservice": NAME, "pod": pod, "metric": metric},
    )


def test_a_slowed_pod_raises_plan_drift_and_clears_when_back(emulator, monkeypatch):
    monkeypatch.setattr(drift, "SETTINGS", SETTINGS)
    drift.clear()
    candidate, workload = drift.planned(spec_mod.resolve(SPEC).fleet, SPEC)
    predicted = plan_drift.predict(candidate, workload, Measured(1.0, 20, RATE, PROMPT, OUTPUT, None, None))
    hosts = ("127.0.0.2", "127.0.0.3")
    port = _free_port(hosts)
    pods = {
        f"{NAME}-a": FakePod(hosts[0], port, predicted.ttft_p50_s, predicted.tpot_p50_s),
        f"{NAME}-b": FakePod(hosts[1], port, predicted.ttft_p50_s, predicted.tpot_p50_s),
    }
    body = {
        "apiVersion": spec_mod.API_VERSION,
        "kind": spec_mod.KIND,
        "metadata": {"name": NAME, "namespace": NS, "uid": "uid-chat", "generation": 1, "resourceVersion": "1"},
        "spec": {**copy.deepcopy(SPEC), "port": port},
    }
    try:
        with KopfRunner(
            ["run", "--standalone", "--all-namespaces", "-m", "kvserve.operator.handlers"], timeout=60
        ) as r:
            for (pod, _), ip in zip(pods.items(), hosts):
                emulator.call("POST", emulator.path(emulator.OTHERS["Pod"], NS), _pod(pod, ip))
            emulator.call("POST", emulator.path(emulator.CR, NS), body)

            # On plan: measured and judged, and within tolerance for more resyncs than a flip takes.
            emulator.wait_for(lambda: _condition(emulator).get("reason") == "WithinTolerance", 40, "WithinTolerance")
            assert "2/2 ready pods measured within tolerance" in _condition(emulator)["message"]
            time.sleep(SETTINGS.resyncs * 0.5 * 3)
            assert _condition(emulator)["status"] == "False", _condition(emulator)
            assert _ratio(f"{NAME}-a", "TPOT") == pytest.approx(1.0, abs=0.15)

            # Slowed: every step twice as long.
            pods[f"{NAME}-b"].factor = 2.0
            slowed_at = time.monotonic()
            emulator.wait_for(lambda: _condition(emulator).get("status") == "True", 40, "PlanDrift=True")
            took_s = time.monotonic() - slowed_at
            cond = _condition(emulator)
            assert cond["reason"] == "SlowerThanPlanned"
            assert cond["message"].startswith(f"1/2 ready pods beyond tolerance for 3 resyncs: pod {NAME}-b: TPOT mean")
            assert f"{NAME}-a" not in cond["message"]
            assert "ms planned (+" in cond["message"]
            # Three judged windows (a slow window may straddle the change): at least 2 resyncs, at most a few more.
            assert 2 * 0.5 <= took_s <= 30, took_s
            assert _ratio(f"{NAME}-b", "TPOT") == pytest.approx(2.0, abs=0.3)
            emulator.wait_for(lambda: len(_warnings(emulator, "SlowerThanPlanned")) == 1, 10, "one Warning Event")
            assert _warnings(emulator, "SlowerThanPlanned")[0]["involvedObject"]["name"] == NAME

            # Back on plan: it clears after the same number of good windows, and no second Event was posted.
            pods[f"{NAME}-b"].factor = 1.0
            emulator.wait_for(lambda: _condition(emulator).get("status") == "False", 40, "PlanDrift cleared")
            assert _condition(emulator)["reason"] == "WithinTolerance"
            assert len(_warnings(emulator, "SlowerThanPlanned")) == 1
        assert r.exit_code == 0 and r.exception is None and "Traceback" not in r.output, r.output[-3000:]
    finally:
        for p in pods.values():
            p.close()
        drift.clear()

"""SIGTERM on a real `kvserve serve` subprocess (no MODEL_DIR: the demo model): in-flight requests complete,
new ones get 503, /health turns 503, and the process exits 0. With a short --drain-timeout, the requests
still running are aborted (finish_reason "abort") and the exit is still 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import free_port

pytestmark = pytest.mark.timeout(120)


class ServeProcess:
    def __init__(self, cache_dir: str, *extra: str):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "KVSERVE_CACHE_DIR": cache_dir}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvserve.cli",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--kv-cache-bytes",
                "32MiB",
                "--max-model-len",
                "2048",
                *extra,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "server exited early:\n" + "".join(self.log)
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill()
        raise AssertionError("server never became healthy:\n" + "".join(self.log))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def stream_completion(base_url: str, max_tokens: int, started: threading.Event, result: dict) -> None:
    body = {
        "prompt": "Keep talking",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, finish, usage = "", None, None
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as resp:
        result["status"] = resp.status_code
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                text += choice["text"]
                finish = choice["finish_reason"] or finish
                started.set()
            usage = chunk.get("usage") or usage
    result.update(text=text, finish=finish, usage=usage)


def start_streams(base_url: str, count: int, max_tokens: int) -> tuple[list[threading.Thread], list[dict]]:
    threads, results = [], []
    for _ in range(count):
        started, result = threading.Event(), {}
        t = threading.Thread(target=stream_completion, args=(base_url, max_tokens, started, result), daemon=True)
        t.start()
        assert started.wait(30), "stream never started"
        threads.append(t)
        results.append(result)
    return threads, results


@pytest.fixture(scope="module")
def cache_dir(demo_model_dir) -> str:
    return str(Path(demo_model_dir).parent)  # the demo model is already built there


def test_sigterm_drains_in_flight_and_exits_zero(cache_dir):
    server = ServeProcess(cache_dir, "--drain-timeout", "60")
    try:
        models = httpx.get(server.base_url + "/v1/models").json()["data"]
        assert models[0]["id"] == "kvserve-demo-random-weights" and models[0]["random_weights"] is True
        threads, results = start_streams(server.base_url, 3, max_tokens=400)

        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while True:  # the drain begins within a moment of the signal
            resp = httpx.post(server.base_url + "/v1/completions", json={"prompt": "late", "max_tokens": 2})
            if resp.status_code == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "service_unavailable"
        assert httpx.get(server.base_url + "/health").status_code == 503

        for t in threads:
            t.join(60)
        for r in results:
            assert r["status"] == 200 and r["finish"] == "length", r
            assert r["usage"]["completion_tokens"] == 400
        assert server.proc.wait(30) == 0, "".join(server.log)
        log = "".join(server.log)
        assert "draining" in log and "RANDOM" in log
    finally:
        server.kill()


def test_drain_timeout_aborts_stragglers_and_exits_zero(cache_dir):
    server = ServeProcess(cache_dir, "--drain-timeout", "0.5")
    try:
        threads, results = start_streams(server.base_url, 2, max_tokens=2000)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert server.proc.wait(30) == 0, "".join(server.log)
        assert time.monotonic() - t0 < 15
        for r in results:
            assert r["finish"] == "abort", r
            assert r["usage"]["completion_tokens"] < 2000
    finally:
        server.kill()

"""The series the alert rules read for failures: `kvserve:healthy` follows /health, and requests the engine
could not finish count as vllm:request_success_total{finished_reason="error"} (vLLM's finish reason)."""

from __future__ import annotations

import httpx
import pytest

from kvserve.runtime.errors import WorkerDiedError
from tests.server.conftest import LiveServer, make_engine

pytestmark = pytest.mark.timeout(120)


def _sample(base_url: str, name: str, **labels: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(base_url + "/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def _complete(srv: LiveServer, prompt: str) -> httpx.Response:
    return httpx.post(srv.base_url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=60)


def test_failed_step_counts_an_error_and_the_engine_stays_healthy(demo_model_dir):
    engine = make_engine(demo_model_dir, in_process=True, kv_cache_bytes=8 << 20, max_model_len=1024)
    srv = LiveServer(engine)
    try:
        assert _sample(srv.base_url, "kvserve:healthy") == 1
        assert _sample(srv.base_url, "vllm:request_success_total", finished_reason="error") is None
        real_execute, calls = engine.executor.execute, {"n": 0}

        def flaky_execute(sched):  # a forward that fails once: its requests fail retryably (issue 9)
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected failure")
            return real_execute(sched)

        engine.executor.execute = flaky_execute
        assert _complete(srv, "doomed").status_code == 503
        assert _complete(srv, "fine").status_code == 200
        assert _sample(srv.base_url, "vllm:request_success_total", finished_reason="error") == 1
        assert _sample(srv.base_url, "kvserve:healthy") == 1  # one bad step is not a dead engine
    finally:
        srv.stop()


def test_dead_engine_turns_healthy_to_zero_and_fails_its_requests_as_errors(demo_model_dir):
    engine = make_engine(demo_model_dir, in_process=True, kv_cache_bytes=8 << 20, max_model_len=1024)
    srv = LiveServer(engine)
    try:

        def dead_step():
            raise WorkerDiedError("rank 1 (pid 4242) exited with SIGKILL", rank=1)

        engine.step = dead_step
        assert _complete(srv, "in flight when it dies").status_code >= 500
        health = httpx.get(srv.base_url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "engine_dead"
        assert _sample(srv.base_url, "kvserve:healthy") == 0
        assert _sample(srv.base_url, "kvserve:draining") == 0  # so KvserveEngineUnhealthy fires
        assert _sample(srv.base_url, "vllm:request_success_total", finished_reason="error") == 1
    finally:
        srv.stop()

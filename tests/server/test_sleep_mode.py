"""Sleep mode (--enable-sleep-mode), vLLM's routes on a live server over the demo model: POST /sleep?level=1|2,
POST /wake_up, GET /is_sleeping; readiness and requests 503 (with Retry-After) while asleep; the same greedy
tokens after a wake as before the sleep; 404 without the flag."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.server.conftest import LiveServer, make_engine

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["The quick brown fox", "Sleep mode frees the KV cache and"]


def greedy_tokens(base_url: str, model: str) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        r = httpx.post(
            base_url + "/v1/completions",
            json={"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["logprobs"]["tokens"])
    return out


@pytest.mark.parametrize("in_process", [False, True], ids=["core_process", "in_process"])
def test_sleep_wake_round_trip_serves_identical_tokens(demo_model_dir, in_process):
    srv = LiveServer(make_engine(demo_model_dir, in_process=in_process, enable_sleep_mode=True))
    try:
        url = srv.base_url
        before = greedy_tokens(url, srv.model)
        assert httpx.get(url + "/is_sleeping", timeout=10).json() == {"is_sleeping": False}
        for level in (1, 2):
            r = httpx.post(url + "/sleep", params={"level": level}, timeout=60)
            assert r.status_code == 200 and r.content == b"", r.text
            assert httpx.get(url + "/is_sleeping", timeout=10).json() == {"is_sleeping": True}
            health = httpx.get(url + "/health", timeout=10)
            assert health.status_code == 503 and health.json() == {"status": "sleeping"}
            assert httpx.get(url + "/ready", timeout=10).status_code == 503
            refused = httpx.post(
                url + "/v1/completions", json={"model": srv.model, "prompt": "x", "max_tokens": 2}, timeout=10
            )
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "5", refused.text
            assert refused.json()["error"]["code"] == "service_unavailable"
            chat = {"model": srv.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=10).status_code == 503
            # What needs no model keeps answering (as in vLLM): the model list, the tokenizer.
            assert httpx.get(url + "/v1/models", timeout=10).status_code == 200
            assert (
                httpx.post(url + "/tokenize", json={"model": srv.model, "prompt": "hi"}, timeout=10).status_code == 200
            )
            assert httpx.post(url + "/sleep", params={"level": level}, timeout=10).status_code == 200  # no-op
            r = httpx.post(url + "/wake_up", timeout=120)
            assert r.status_code == 200, r.text
            assert httpx.get(url + "/is_sleeping", timeout=10).json() == {"is_sleeping": False}
            assert httpx.get(url + "/health", timeout=10).status_code == 200
            assert greedy_tokens(url, srv.model) == before, f"level {level}"
        bad = httpx.post(url + "/sleep", params={"level": 3}, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "level"
        assert httpx.get(url + "/health", timeout=10).status_code == 200
    finally:
        srv.stop()


def test_level_one_frees_the_kv_cache_and_level_two_the_weights(demo_model_dir):
    engine = make_engine(demo_model_dir, in_process=True, enable_sleep_mode=True)
    srv = LiveServer(engine)
    try:
        runner = engine.core.executor.runner
        weights = runner.model
        assert httpx.post(srv.base_url + "/sleep", params={"level": 1}, timeout=60).status_code == 200
        assert runner.kv_caches == [] and runner.model is weights  # on CPU the weights are host memory already
        assert httpx.post(srv.base_url + "/wake_up", timeout=60).status_code == 200
        assert len(runner.kv_caches) > 0 and float(runner.kv_caches[0][0].abs().sum()) == 0.0  # fresh, zeroed
        assert httpx.post(srv.base_url + "/sleep", params={"level": 2}, timeout=60).status_code == 200
        assert runner.kv_caches == [] and runner.model is None
        assert httpx.post(srv.base_url + "/wake_up", timeout=120).status_code == 200
        assert runner.model is not None and runner.model is not weights  # re-read from the checkpoint
        assert engine.core.kv_cache_manager.pool.cached_blocks == {}  # the prefix cache was reset on wake
    finally:
        srv.stop()


def test_routes_are_absent_without_the_flag(server):
    url = server.base_url
    assert httpx.post(url + "/sleep", params={"level": 1}, timeout=10).status_code == 404
    assert httpx.post(url + "/wake_up", timeout=10).status_code == 404
    assert httpx.get(url + "/is_sleeping", timeout=10).status_code == 404
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_sleep_waits_for_the_requests_in_flight(demo_model_dir):
    """/sleep refuses new requests at once but lets the running one finish before the engine frees memory."""
    import threading

    srv = LiveServer(make_engine(demo_model_dir, enable_sleep_mode=True))
    try:
        url = srv.base_url
        body = {"model": srv.model, "prompt": "a long answer", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        result = {}
        worker = threading.Thread(
            target=lambda: result.update(r=httpx.post(url + "/v1/completions", json=body, timeout=120))
        )
        worker.start()
        deadline = time.monotonic() + 30
        while srv.state.engine.num_in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.state.engine.num_in_flight == 1
        assert httpx.post(url + "/sleep", params={"level": 1}, timeout=120).status_code == 200
        worker.join(120)
        r = result["r"]
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 400, r.text
        assert httpx.get(url + "/is_sleeping", timeout=10).json() == {"is_sleeping": True}
        assert httpx.post(url + "/wake_up", timeout=60).status_code == 200
    finally:
        srv.stop()

"""The router in P/D mode against fake engines that speak vLLM's kv_transfer_params protocol, over real sockets:
the two legs' exact bodies, the decision rule, the fallback to aggregated serving on every kind of prefill
failure (a prefill process killed mid-request included), streaming on the D leg, saturation."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from pd_fake_engine import PREFILL_CACHED_TOKENS, answer_tokens

from kvserve.runtime.router.pd import prefill_body

pytestmark = pytest.mark.timeout(90)

TESTS = pathlib.Path(__file__).resolve().parents[1]
LONG = " ".join(f"t{i}" for i in range(40))  # 40 tokens with the WordTokenizer: 10 blocks of 4
SHORT = "a b c d e"
PD = {"max_local_prefill_length": 16}  # tokens: the tests' prompts are short


def _pd_router(fakes, prefill: list[str], decode: list[str], **config):
    return fakes.router([], prefill=prefill, decode=decode, tokenizer=fakes.WordTokenizer(), **{**PD, **config})


def _pd_metric(router, path: str, reason: str) -> float:
    return router.metric("kvserve_router:pd_requests_total", path=path, reason=reason)


def _events(text: str) -> list[dict]:
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_long_uncached_prompt_is_prefilled_remotely_with_vllms_exact_leg_bodies(fakes):
    p, d = fakes.engines("p", "d")
    router = _pd_router(fakes, [p.url], [d.url])
    original = {"model": "fake", "prompt": LONG, "max_tokens": 5, "min_tokens": 2, "temperature": 0, "stream": False}
    resp = httpx.post(router.url + "/v1/completions", json=original, timeout=20)
    assert resp.status_code == 200 and resp.headers["x-kvserve-endpoint"] == d.url
    # P leg: the toy proxy's body.
    assert p.state.received == [
        {
            "model": "fake",
            "prompt": LONG,
            "max_tokens": 1,
            "temperature": 0,
            "stream": False,
            "kv_transfer_params": {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            },
        }
    ]
    # D leg: the client's body plus exactly what P returned; one request id on both legs.
    (d_body,) = d.state.received
    params = d_body.pop("kv_transfer_params")
    assert d_body == original
    assert params["do_remote_prefill"] is True and params["remote_block_ids"] == [7, 8, 9]
    assert params["remote_engine_id"] == "engine-p" and params["remote_request_id"] == p.state.request_ids[0]
    assert p.state.request_ids[0] and p.state.request_ids == d.state.request_ids
    # The client sees the decode leg's answer, with the prefill engine's cache hit in its usage.
    body = resp.json()
    assert body["choices"][0]["text"] == " ".join(answer_tokens(original))
    assert body["usage"]["prompt_tokens"] == 40 and body["usage"]["completion_tokens"] == 5
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": PREFILL_CACHED_TOKENS}
    assert _pd_metric(router, "remote_prefill", "long_uncached") == 1
    assert router.metric("kvserve_router:prefill_leg_seconds_count", replica=p.url, outcome="ok") == 1
    assert router.in_flight() == 0


def test_short_prompt_is_prefilled_locally(fakes):
    p, d = fakes.engines("p", "d")
    router = _pd_router(fakes, [p.url], [d.url])
    original = {"prompt": SHORT, "max_tokens": 2}
    resp = httpx.post(router.url + "/v1/completions", json=original, timeout=20)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == " ".join(answer_tokens(original))
    assert p.state.received == [] and d.state.received == [original]
    assert _pd_metric(router, "local", "short") == 1


def test_a_prefix_cached_on_the_decode_replica_is_prefilled_locally(fakes):
    p, d = fakes.engines("p", "d")
    router = _pd_router(fakes, [p.url], [d.url])
    assert httpx.post(router.url + "/v1/completions", json={"prompt": LONG}, timeout=20).status_code == 200
    assert len(p.state.received) == 1  # the first time: remote
    # The same conversation, 4 tokens longer: the decode replica holds 40 of its 44 tokens.
    follow_up = {"prompt": LONG + " u1 u2 u3 u4"}
    assert httpx.post(router.url + "/v1/completions", json=follow_up, timeout=20).status_code == 200
    assert len(p.state.received) == 1 and d.state.received[-1] == follow_up
    assert _pd_metric(router, "local", "cached") == 1
    # A long prompt the decode replica does not hold goes remote again.
    other = {"prompt": " ".join(f"x{i}" for i in range(40))}
    assert httpx.post(router.url + "/v1/completions", json=other, timeout=20).status_code == 200
    assert len(p.state.received) == 2 and _pd_metric(router, "remote_prefill", "long_uncached") == 2


def test_streamed_chat_decode_leg_reaches_the_client_with_usage_rewritten(fakes):
    """Chat, no tokenizer for it (the length is estimated from characters), streamed with usage."""
    p, d = fakes.engines("p", "d")
    router = _pd_router(fakes, [p.url], [d.url])
    original = {
        "model": "fake",
        "messages": [{"role": "user", "content": "word " * 40}],
        "max_completion_tokens": 3,
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=original, timeout=20) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        text = resp.read().decode()
    (p_body,) = p.state.received
    assert p_body["stream"] is False and "stream_options" not in p_body
    assert p_body["max_tokens"] == 1 and p_body["max_completion_tokens"] == 1
    (d_body,) = d.state.received
    assert d_body.pop("kv_transfer_params")["do_remote_prefill"] is True and d_body == original
    events = _events(text)
    assert [e["choices"][0]["text"] for e in events if e["choices"]] == answer_tokens(original)
    (usage,) = [e["usage"] for e in events if e.get("usage")]
    assert usage["prompt_tokens_details"]["cached_tokens"] == PREFILL_CACHED_TOKENS
    assert _pd_metric(router, "remote_prefill", "long_uncached") == 1


def test_n_lora_and_structured_outputs_pass_through_both_legs(fakes):
    p, d = fakes.engines("p", "d")
    router = _pd_router(fakes, [p.url], [d.url])
    original = {
        "model": "my-lora",
        "prompt": LONG,
        "n": 2,
        "max_tokens": 3,
        "response_format": {"type": "json_object"},
        "guided_choice": ["yes", "no"],
    }
    resp = httpx.post(router.url + "/v1/completions", json=original, timeout=20)
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 2
    assert p.state.received == [prefill_body(original)]
    d_body = dict(d.state.received[0])
    d_body.pop("kv_transfer_params")
    assert d_body == original


FAILURES = [
    ("500", "http_500"),
    ("503", "http_503"),
    ("no_params", "no_kv_transfer_params"),
    ("bad_json", "bad_answer"),
    ("hang", "timeout"),
    ("dead", "connect_error"),
]


@pytest.mark.parametrize("mode,cause", FAILURES, ids=[m for m, _ in FAILURES])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_any_prefill_failure_falls_back_to_aggregated_serving(fakes, mode, cause, stream):
    (d,) = fakes.engines("d")
    if mode == "dead":
        p_url = fakes.dead_url()
    else:
        (p,) = fakes.engines("p", mode=mode)
        p_url = p.url
    router = _pd_router(fakes, [p_url], [d.url], prefill_timeout_s=0.5)
    original = {"prompt": LONG, "max_tokens": 3, "stream": stream}
    resp = httpx.post(router.url + "/v1/completions", json=original, timeout=20)
    assert resp.status_code == 200 and resp.headers["x-kvserve-endpoint"] == d.url
    # One complete answer, served by the decode replica from the client's own body.
    if stream:
        texts = [e["choices"][0]["text"] for e in _events(resp.text)]
    else:
        texts = resp.json()["choices"][0]["text"].split()
    assert texts == answer_tokens(original)
    assert d.state.received == [original]
    assert _pd_metric(router, "fallback", cause) == 1
    assert router.metric("kvserve_router:prefill_leg_seconds_count", replica=p_url, outcome=cause) == 1
    assert router.in_flight() == 0


def test_killing_the_prefill_process_mid_request_loses_nothing(fakes):
    (d,) = fakes.engines("d")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    proc = subprocess.Popen([sys.executable, str(TESTS / "pd_fake_engine.py"), str(port), "p", "hang"], env=env)
    try:
        p_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(p_url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the prefill process did not start"
            time.sleep(0.1)
        router = _pd_router(fakes, [p_url], [d.url])
        original = {"prompt": LONG, "max_tokens": 4, "stream": True}
        result: dict = {}

        def client() -> None:
            result["resp"] = httpx.post(router.url + "/v1/completions", json=original, timeout=30)

        thread = threading.Thread(target=client)
        thread.start()
        deadline = time.monotonic() + 10
        while router.router.replicas.replicas[p_url].in_flight == 0:  # the P leg is running
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        thread.join(30)
    finally:
        proc.kill()
        proc.wait(10)
    resp = result["resp"]
    assert resp.status_code == 200
    assert [e["choices"][0]["text"] for e in _events(resp.text)] == answer_tokens(original)
    assert d.state.received == [original]
    assert _pd_metric(router, "fallback", "reset") == 1
    assert router.router.replicas.replicas[p_url].ejected_until is not None


def test_a_saturated_prefill_pool_means_local_prefill(fakes):
    p, d = fakes.engines("p", "d")
    router = _pd_router(fakes, [p.url], [d.url], max_prefill_queue=2)
    p.state.waiting = 2
    router.poll()
    assert httpx.post(router.url + "/v1/completions", json={"prompt": LONG}, timeout=20).status_code == 200
    assert p.state.received == [] and _pd_metric(router, "local", "prefill_saturated") == 1
    p.state.waiting = 1
    router.poll()
    other = " ".join(f"x{i}" for i in range(40))  # LONG is cached on the decode replica now
    assert httpx.post(router.url + "/v1/completions", json={"prompt": other}, timeout=20).status_code == 200
    assert len(p.state.received) == 1 and _pd_metric(router, "remote_prefill", "long_uncached") == 1


@pytest.mark.parametrize(
    "decider,prompt,path,reason",
    [("always", SHORT, "remote_prefill", "always"), ("never", LONG, "local", "disabled")],
)
def test_the_decider_is_configurable(fakes, decider, prompt, path, reason):
    p, d = fakes.engines("p", "d")
    router = _pd_router(fakes, [p.url], [d.url], pd_decider=decider)
    assert httpx.post(router.url + "/v1/completions", json={"prompt": prompt}, timeout=20).status_code == 200
    assert len(p.state.received) == (1 if path == "remote_prefill" else 0)
    assert _pd_metric(router, path, reason) == 1


def test_prefill_replicas_never_take_a_whole_request_and_without_them_nothing_changes(fakes):
    p, d = fakes.engines("p", "d")
    router = _pd_router(fakes, [p.url], [d.url])
    for i in range(6):
        resp = httpx.post(router.url + "/v1/completions", json={"prompt": f"{SHORT} {i}"}, timeout=20)
        assert resp.headers["x-kvserve-endpoint"] == d.url
    assert p.state.received == []
    # Only both-role replicas (no prefill role): no P/D decision is made at all.
    (a,) = fakes.engines("a")
    plain = fakes.router([a.url], tokenizer=fakes.WordTokenizer(), **PD)
    assert httpx.post(plain.url + "/v1/completions", json={"prompt": LONG}, timeout=20).status_code == 200
    assert a.state.received == [{"prompt": LONG}]
    assert plain.router.metrics.pd_requests.collect()[0].samples == []


def test_a_client_leaving_during_the_prefill_leg_ends_it(fakes):
    p, d = fakes.engines("p", "d")
    p.state.mode = "hang"
    router = _pd_router(fakes, [p.url], [d.url])
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(router.url + "/v1/completions", json={"prompt": LONG}, timeout=0.5)
    assert router.in_flight() == 0  # the P leg's lease is released: the leg was cancelled
    assert router.metric("kvserve_router:client_disconnects_total") == 1
    assert d.state.received == [] and len(p.state.received) == 1


def test_a_prefill_pool_alone_does_not_make_the_router_ready(fakes):
    (p,) = fakes.engines("p")
    router = fakes.router([], prefill=[p.url])
    health = httpx.get(router.url + "/health", timeout=5)
    assert health.status_code == 503 and health.json()["replicas"] == 1
    assert httpx.post(router.url + "/v1/completions", json={"prompt": LONG}, timeout=5).status_code == 503
    assert p.state.received == []


def test_concurrent_requests_with_a_flaky_prefill_replica_all_get_one_complete_answer(fakes):
    p1, p2, d1, d2 = fakes.engines("p1", "p2", "d1", "d2")
    p2.state.mode = "flaky"
    router = _pd_router(fakes, [p1.url, p2.url], [d1.url, d2.url], max_prefill_queue=100)
    bodies = [
        {"prompt": " ".join(f"c{i}-{j}" for j in range(30 + i)), "max_tokens": 3, "stream": i % 2 == 0}
        for i in range(16)
    ]
    results: list[httpx.Response | None] = [None] * len(bodies)

    def client(i: int) -> None:
        results[i] = httpx.post(router.url + "/v1/completions", json=bodies[i], timeout=30)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for body, resp in zip(bodies, results):
        assert resp is not None and resp.status_code == 200
        if body["stream"]:
            texts = [e["choices"][0]["text"] for e in _events(resp.text)]
        else:
            texts = resp.json()["choices"][0]["text"].split()
        assert texts == answer_tokens(body)
    remote = _pd_metric(router, "remote_prefill", "long_uncached")
    fallback = _pd_metric(router, "fallback", "http_500")
    assert remote + fallback == len(bodies) and remote >= 1
    assert fallback == len(p2.state.received) // 2 and fallback >= 1  # p2 fails its 2nd, 4th, ... leg
    # Each request reached a decode replica exactly once: with P's params after a good leg, bare after a failed one.
    decoded = d1.state.received + d2.state.received
    assert len(decoded) == len(bodies)
    assert sum(1 for b in decoded if "kv_transfer_params" in b) == remote
    assert router.in_flight() == 0


def test_local_when_the_best_prefill_replica_is_the_decode_replica_or_none_is_live(fakes):
    p, b, d = fakes.engines("p", "b", "d")
    router = fakes.router([b.url], prefill=[p.url], tokenizer=fakes.WordTokenizer(), **PD)
    # The prefill replica is busy (its waiting gauge): the both replica, already the decode pick, ranks first.
    p.state.waiting = 50
    router.poll()
    assert httpx.post(router.url + "/v1/completions", json={"prompt": LONG}, timeout=20).status_code == 200
    assert _pd_metric(router, "local", "same_replica") == 1 and p.state.received == []
    assert b.state.received == [{"prompt": LONG}]
    # Decode-only replicas and a prefill pool whose one replica is draining (its EndpointSlice says so).
    router = _pd_router(fakes, [p.url], [d.url])
    router.router.replicas.replicas[p.url].draining = True
    assert httpx.post(router.url + "/v1/completions", json={"prompt": LONG}, timeout=20).status_code == 200
    assert _pd_metric(router, "local", "no_prefill_replica") == 1 and p.state.received == []
    assert d.state.received == [{"prompt": LONG}]

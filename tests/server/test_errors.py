"""Hostile and malformed input: every request gets a 4xx OpenAI-style error naming the problem, and the
engine keeps serving everyone else. Also API keys (401), unknown models (404) and backpressure (429)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.server.conftest import LiveServer, make_engine

pytestmark = pytest.mark.timeout(120)

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_MSG = [{"role": "user", "content": "hi"}]


def hostile_requests(model: str) -> list[tuple[str, str, object, int | None, str | None]]:
    """(method, path, body (dict -> JSON; bytes/str -> raw), expected status (None: any 4xx), expected param)."""
    big = "lighthouse " * 100_000  # ~1.1 MB
    nested = "[" * 100_000 + "]" * 100_000
    return [
        ("POST", C, b'{"prompt": "x",', 400, None),  # truncated JSON
        ("POST", C, b"hello", 400, None),  # not JSON
        ("POST", C, b"[1, 2, 3]", 400, None),  # JSON but not an object
        ("POST", C, b"", 400, None),  # empty body
        ("POST", C, b'{"prompt": "\xff\xfe\xfa"}', 400, None),  # invalid UTF-8
        ("POST", C, ('{"prompt": ' + nested + "}").encode(), 400, None),  # nesting bomb
        ("POST", C, {"model": model}, 400, "prompt"),  # missing prompt
        ("POST", C, {"prompt": 123}, 400, "prompt"),
        ("POST", C, {"prompt": None}, 400, "prompt"),
        ("POST", C, {"prompt": []}, 400, "prompt"),
        ("POST", C, {"prompt": ["a", 1]}, 400, "prompt"),
        ("POST", C, {"prompt": [-1, 5]}, 400, "prompt"),
        ("POST", C, {"prompt": [10**9]}, 400, "prompt"),
        ("POST", C, {"prompt": [True, False]}, 400, "prompt"),
        ("POST", C, {"prompt": ""}, 400, "prompt"),
        ("POST", C, {"prompt": big}, 400, "prompt"),  # 1 MB prompt
        ("POST", C, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ("POST", C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("POST", C, {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
        ("POST", C, {"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
        ("POST", C, {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens"),
        ("POST", C, b'{"prompt": "x", "max_tokens": Infinity}', 400, "max_tokens"),
        ("POST", C, {"prompt": "x", "temperature": -1}, 400, "temperature"),
        ("POST", C, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ("POST", C, b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
        ("POST", C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
        ("POST", C, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
        ("POST", C, {"prompt": "x", "top_k": -5}, 400, "top_k"),
        ("POST", C, {"prompt": "x", "min_p": 2}, 400, "min_p"),
        ("POST", C, {"prompt": "x", "n": 0}, 400, "n"),
        ("POST", C, {"prompt": "x", "n": 10000}, 400, "n"),
        ("POST", C, {"prompt": "x", "n": "two"}, 400, "n"),
        ("POST", C, {"prompt": "x", "presence_penalty": 5}, 400, "presence_penalty"),
        ("POST", C, {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
        ("POST", C, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
        ("POST", C, {"prompt": "x", "logprobs": 100}, 400, "logprobs"),
        ("POST", C, {"prompt": "x", "logprobs": -1}, 400, "logprobs"),
        ("POST", C, {"prompt": "x", "stop": 123}, 400, "stop"),
        ("POST", C, {"prompt": "x", "stop": ["s"] * 100}, 400, "stop"),
        ("POST", C, {"prompt": "x", "stop": [""]}, 400, "stop"),
        ("POST", C, {"prompt": "x", "stream": "yes"}, 400, "stream"),
        ("POST", C, {"prompt": "x", "stream": True, "stream_options": "usage"}, 400, "stream_options"),
        ("POST", C, {"prompt": "x", "seed": "abc"}, 400, "seed"),
        ("POST", C, {"prompt": "x", "max_tokens": 5, "min_tokens": 10}, 400, "min_tokens"),
        ("POST", C, {"prompt": "x", "best_of": 3}, 400, "best_of"),
        ("POST", C, {"prompt": "x", "suffix": "tail"}, 400, "suffix"),
        ("POST", C, {"prompt": "x", "logit_bias": {"5": 100}}, 400, "logit_bias"),
        ("POST", C, {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
        ("POST", C, {"prompt": "x", "model": "gpt-4"}, 404, "model"),  # unknown model
        ("POST", C, {"prompt": "x", "model": 7}, 400, "model"),
        ("POST", CHAT, {"messages": []}, 400, "messages"),  # empty messages
        ("POST", CHAT, {"model": model}, 400, "messages"),  # missing messages
        ("POST", CHAT, {"messages": "hi"}, 400, "messages"),
        ("POST", CHAT, {"messages": [{"content": "hi"}]}, 400, "messages.0.role"),
        ("POST", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
        ("POST", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
        ("POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None),
        ("POST", CHAT, {"messages": OK_MSG, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
        ("POST", CHAT, {"messages": OK_MSG, "top_logprobs": 2}, 400, "top_logprobs"),
        ("POST", CHAT, {"messages": OK_MSG, "max_completion_tokens": -5}, 400, "max_completion_tokens"),
        ("POST", CHAT, {"messages": OK_MSG, "max_tokens": 10**9}, 400, "max_tokens"),
        ("POST", CHAT, {"messages": [{"role": "user", "content": big}]}, 400, None),  # 1 MB message
        ("POST", CHAT, {"messages": OK_MSG, "model": "nope"}, 404, "model"),
        ("POST", CHAT, {"messages": OK_MSG, "n": 10000}, 400, "n"),
        ("POST", CHAT, {"messages": OK_MSG, "tools": [{"type": "function"}]}, 400, "tools"),
        ("POST", "/tokenize", {}, 400, "prompt"),
        ("POST", "/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("POST", "/detokenize", {"tokens": "abc"}, 400, "tokens"),
        # issue 9: every id-valued field below the vocabulary, int64 seeds, bounded lists, valid Unicode
        ("POST", C, {"prompt": "x", "seed": 2**64}, 400, "seed"),
        ("POST", C, {"prompt": "x", "seed": 2**63 - 1, "n": 2}, 400, "seed"),  # seed + 1 overflows
        ("POST", C, {"prompt": "x", "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
        ("POST", C, {"prompt": "x", "stop_token_ids": [1] * 2000}, 400, "stop_token_ids"),
        ("POST", C, {"prompt": "x", "stop": ["a" * 2000]}, 400, "stop"),
        ("POST", C, {"prompt": "x", "min_tokens": 10**6, "max_tokens": None}, 400, "min_tokens"),
        ("POST", C, {"prompt": [5] * 5000}, 400, "prompt"),  # more ids than max_model_len, refused while parsing
        ("POST", C, {"prompt": [[5], [5] * 5000]}, 400, "prompt"),
        ("POST", C, b'{"prompt": "a lone \\ud800 surrogate"}', 400, "prompt"),
        ("POST", CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "messages.0.content"),
        ("POST", CHAT, {"messages": OK_MSG * 3000}, 400, "messages"),  # more turns than max_model_len
        ("POST", CHAT, {"messages": OK_MSG, "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
        ("GET", C, None, 405, None),  # wrong method
        ("POST", "/v1/engines/davinci/completions", {"prompt": "x"}, 404, None),  # unknown route
    ]


def _send(client: httpx.Client, method: str, path: str, body: object) -> httpx.Response:
    if body is None:
        return client.request(method, path)
    if isinstance(body, (bytes, str)):
        return client.request(method, path, content=body, headers={"content-type": "application/json"})
    return client.request(method, path, json=body)


def test_hostile_requests_get_openai_errors_and_engine_keeps_serving(server):
    cases = hostile_requests(server.model)
    assert len(cases) >= 40
    failures = []
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        for method, path, body, status, param in cases:
            resp = _send(client, method, path, body)
            label = f"{method} {path} {str(body)[:80]!r}"
            if not 400 <= resp.status_code < 500 or (status is not None and resp.status_code != status):
                failures.append(f"{label}: status {resp.status_code} (want {status}): {resp.text[:200]}")
                continue
            try:
                error = resp.json()["error"]
            except (ValueError, KeyError):
                failures.append(f"{label}: not an OpenAI error body: {resp.text[:200]}")
                continue
            if set(error) != {"message", "type", "param", "code"} or not error["message"]:
                failures.append(f"{label}: bad error shape {error}")
            elif param is not None and not str(error["param"]).startswith(param):
                failures.append(f"{label}: param {error['param']!r} (want {param!r}): {error['message']}")
    assert not failures, "\n".join(failures)
    # ...and a normal request succeeds right after, on the same engine
    resp = server.openai().completions.create(model=server.model, prompt="hello", max_tokens=4, temperature=0)
    assert resp.usage.completion_tokens == 4
    chat = server.openai().chat.completions.create(model=server.model, messages=OK_MSG, max_tokens=3)
    assert chat.choices[0].finish_reason in ("length", "stop")
    assert server.state.engine.is_running and server.state.engine.num_step_failures == 0


def test_openai_client_sees_typed_errors(server):
    client = server.openai()
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=server.model, prompt="x", max_tokens=10**9)
    assert exc.value.body["param"] == "max_tokens" and "maximum context length" in exc.value.body["message"]
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="no-such-model", prompt="x")
    assert exc.value.body["code"] == "model_not_found"


def test_api_key(demo_model_dir):
    srv = LiveServer(make_engine(demo_model_dir, kv_cache_bytes=8 << 20, max_model_len=1024), api_key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            srv.openai(api_key="wrong").completions.create(model=srv.model, prompt="x", max_tokens=2)
        resp = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x"})  # no key at all
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.base_url + "/v1/models").status_code == 401
        ok = srv.openai(api_key="s3cret").completions.create(model=srv.model, prompt="x", max_tokens=2)
        assert ok.usage.completion_tokens == 2
        assert httpx.get(srv.base_url + "/health").status_code == 200  # probes need no key
        assert httpx.get(srv.base_url + "/metrics").status_code == 200
    finally:
        srv.stop()


def test_queue_full_gets_429_with_retry_after(demo_model_dir):
    # One running sequence at a time, at most 2 waiting: the rest of a burst of 12 must be told to back off.
    srv = LiveServer(
        make_engine(demo_model_dir, kv_cache_bytes=8 << 20, max_model_len=1024, max_num_seqs=1), max_queue_len=2
    )
    try:

        async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
            return await client.post(
                "/v1/completions", json={"prompt": f"burst {i}", "max_tokens": 24, "ignore_eos": True, "temperature": 0}
            )

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as client:
                results = []
                for i in range(12):  # staggered so the engine has taken the first ones in
                    results.append(asyncio.ensure_future(one(client, i)))
                    await asyncio.sleep(0.02)
                return await asyncio.gather(*results)

        responses = asyncio.run(burst())
        codes = [r.status_code for r in responses]
        assert codes.count(200) >= 2 and codes.count(429) >= 1 and set(codes) <= {200, 429}, codes
        rejected = next(r for r in responses if r.status_code == 429)
        assert int(rejected.headers["retry-after"]) >= 1
        assert rejected.json()["error"]["code"] == "queue_full"
        srv.wait_idle()
        ok = srv.openai().completions.create(model=srv.model, prompt="after", max_tokens=2)  # served again
        assert ok.usage.completion_tokens == 2
        assert (
            'kvserve:http_requests_rejected_total{engine="0",model_name="test-model",reason="queue_full"}'
            in httpx.get(srv.base_url + "/metrics").text
        )
    finally:
        srv.stop()


def test_engine_loop_survives_a_failing_step(demo_model_dir):
    """A step whose forward raises fails only the requests in it, retryably (HTTP 503 + Retry-After, no
    Python repr in the body); the next requests are served and every block is freed."""
    engine = make_engine(demo_model_dir, in_process=True, kv_cache_bytes=8 << 20, max_model_len=1024)
    srv = LiveServer(engine)
    try:
        real_execute = engine.executor.execute
        calls = {"n": 0}

        def flaky_execute(sched):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected failure")
            return real_execute(sched)

        engine.executor.execute = flaky_execute
        resp = httpx.post(srv.base_url + C, json={"prompt": "doomed", "max_tokens": 4}, timeout=30)
        assert resp.status_code == 503 and int(resp.headers["retry-after"]) >= 1
        error = resp.json()["error"]
        assert error["code"] == "engine_step_failed" and "RuntimeError" not in error["message"]
        ok = srv.openai().completions.create(model=srv.model, prompt="fine", max_tokens=4)
        assert ok.usage.completion_tokens == 4
        stats = srv.wait_idle()
        assert stats.num_free_blocks == stats.num_total_blocks
        assert httpx.get(srv.base_url + "/health").status_code == 200
        assert (
            'kvserve:engine_step_failures_total{engine="0",model_name="test-model"} 1.0'
            in httpx.get(srv.base_url + "/metrics").text
        )
    finally:
        srv.stop()


def test_health_503_while_loading(demo_model_dir):
    """Started with an engine factory, the server answers /health 503 (and requests 503) until loaded."""
    import threading

    import uvicorn

    from kvserve.runtime.server.app import build_app
    from kvserve.runtime.server.state import ServerConfig
    from tests.server.conftest import free_port

    release = threading.Event()

    def slow_factory():
        release.wait(30)
        return make_engine(demo_model_dir, kv_cache_bytes=8 << 20, max_model_len=1024)

    app = build_app(ServerConfig(served_model_names=["m"]), engine_factory=slow_factory)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                resp = httpx.get(base + "/health")
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert resp.status_code == 503 and resp.json()["status"] == "loading"
        busy = httpx.post(base + "/v1/completions", json={"prompt": "x"})
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "service_unavailable"
        # Every API route is honest while loading (issue 26): /v1/models too, not a 200 that invites traffic.
        for route_resp in (
            httpx.get(base + "/v1/models"),
            httpx.post(base + "/tokenize", json={"prompt": "x"}),
            httpx.get(base + "/ready"),
        ):
            assert route_resp.status_code == 503, route_resp.request.url
        assert httpx.get(base + "/v1/models").json()["error"]["code"] == "service_unavailable"
        release.set()
        deadline = time.monotonic() + 30
        while httpx.get(base + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
        assert httpx.get(base + "/v1/models").status_code == 200
        assert httpx.get(base + "/ready").json() == {"status": "ok"}
    finally:
        release.set()
        server.should_exit = True
        thread.join(15)


def test_error_bodies_are_json_with_message():
    from kvserve.runtime.server.errors import error_response

    body = json.loads(error_response(400, "bad", param="n").body)
    assert body == {"error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}}

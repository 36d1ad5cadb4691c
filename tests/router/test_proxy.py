"""The proxy against fake replicas over real sockets: streaming passthrough, retries before the first byte,
ejection and re-probe, 429 passthrough, client disconnects, mid-stream failures, prefix affinity."""

from __future__ import annotations

import json
import time

import httpx
import pytest

pytestmark = pytest.mark.timeout(60)


def _events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def test_sse_streams_through_unbuffered(fakes):
    (a,) = fakes("a", events=4, gap_s=0.4)
    router = fakes.router([a.url])
    arrivals = []
    start = time.perf_counter()
    with httpx.stream("POST", router.url + "/v1/completions", json={"prompt": "x", "stream": True}, timeout=20) as resp:
        assert resp.status_code == 200 and resp.headers["x-kvserve-endpoint"] == a.url
        assert resp.headers["content-type"].startswith("text/event-stream")
        body = b""
        for chunk in resp.iter_raw():
            arrivals.append(time.perf_counter() - start)
            body += chunk
    # The first event reaches the client while the replica is still producing (4 events 0.4 s apart).
    assert arrivals[0] < 0.35 and arrivals[-1] > 1.5, arrivals
    assert _events(body.decode())[-1] == "[DONE]" and len(_events(body.decode())) == 5
    assert router.in_flight() == 0
    assert router.metric("kvserve_router:requests_total", replica=a.url, reason="only") == 1


def test_connect_refused_is_retried_on_the_next_replica_and_ejected(fakes):
    (a,) = fakes("a")
    dead = fakes.dead_url()
    router = fakes.router([a.url, dead], eject_base_s=30)
    for i in range(4):
        resp = fakes.completion(router, f"p{i}")
        assert resp.status_code == 200 and resp.headers["x-kvserve-endpoint"] == a.url
    assert len(a.received) == 4
    # The dead replica cost at most one retry: after it, it is out of rotation.
    assert router.metric("kvserve_router:retries_total", replica=dead, cause="connect_error") == 1
    assert router.metric("kvserve_router:ejections_total", replica=dead, cause="connect_error") == 1
    assert router.router.replicas.replicas[dead].ejected_until is not None
    assert router.in_flight() == 0


def test_503_is_retried_then_the_replica_is_reprobed_and_readmitted(fakes):
    a, b = fakes("a", "b")
    b.mode, b.healthy = "503", False
    router = fakes.router([a.url, b.url], eject_base_s=0.2)
    for i in range(4):
        resp = fakes.completion(router, f"p{i}")
        assert resp.status_code == 200 and resp.headers["x-kvserve-endpoint"] == a.url
    assert len(b.received) == 1 and len(a.received) == 4  # b answered 503 once, then was ejected
    assert router.metric("kvserve_router:retries_total", replica=b.url, cause="http_503") == 1
    time.sleep(0.25)
    router.poll()  # back-off over, /health still 503: stays out, back-off doubles
    assert router.router.replicas.replicas[b.url].ejected_until is not None
    b.mode, b.healthy = "ok", True
    time.sleep(0.45)
    router.poll()
    assert router.router.replicas.replicas[b.url].ejected_until is None
    seen = {fakes.completion(router, f"q{i}").headers["x-kvserve-endpoint"] for i in range(12)}
    assert seen == {a.url, b.url}


def test_503_from_every_replica_is_passed_through(fakes):
    a, b = fakes("a", "b")
    a.mode = b.mode = "503"
    router = fakes.router([a.url, b.url])
    resp = fakes.completion(router)
    assert resp.status_code == 503 and len(a.received) + len(b.received) == 2


def test_429_and_retry_after_pass_through_without_retry(fakes):
    a, b = fakes("a", "b")
    a.mode = b.mode = "429"
    router = fakes.router([a.url, b.url])
    resp = fakes.completion(router)
    assert resp.status_code == 429 and resp.headers["retry-after"] == "7"
    assert resp.json()["error"]["message"] == "queue full"
    assert len(a.received) + len(b.received) == 1  # not retried: the client decides when to come back


def test_client_disconnect_mid_stream_aborts_upstream(fakes):
    (a,) = fakes("a", events=100, gap_s=0.1)
    router = fakes.router([a.url])
    with httpx.stream("POST", router.url + "/v1/completions", json={"prompt": "x", "stream": True}, timeout=20) as resp:
        next(resp.iter_raw())
    deadline = time.monotonic() + 5
    while a.cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a.cancelled == 1
    assert router.in_flight() == 0


def test_client_disconnect_before_the_first_byte_aborts_upstream(fakes):
    (a,) = fakes("a")
    a.mode = "hang"  # headers, then silence (a non-streamed completion still running)
    router = fakes.router([a.url])
    with pytest.raises(httpx.ReadTimeout):
        fakes.completion(router, stream=False, timeout=0.5)
    deadline = time.monotonic() + 5
    while a.cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a.cancelled == 1 and router.in_flight() == 0
    assert router.metric("kvserve_router:client_disconnects_total") == 1


def test_replica_failing_mid_stream_ends_the_stream_with_an_error_event(fakes):
    (a,) = fakes("a", events=3)
    a.mode = "break"
    router = fakes.router([a.url], eject_base_s=30)
    resp = fakes.completion(router)
    events = _events(resp.text)
    assert json.loads(events[0]) == {"replica": "a", "i": 0}  # what the replica sent came through
    assert json.loads(events[1])["error"]["code"] == "upstream_error" and events[-1] == "[DONE]"
    assert router.metric("kvserve_router:ejections_total", replica=a.url, cause="stream_broken") == 1
    assert router.in_flight() == 0


def test_a_growing_conversation_sticks_to_its_replica(fakes):
    replicas = fakes("a", "b", "c")
    router = fakes.router([r.url for r in replicas], tokenizer=fakes.WordTokenizer())
    homes = {}
    for conv in range(6):
        history = f"conversation {conv} " + " ".join(f"w{conv}x{i}" for i in range(40))
        for turn in range(4):
            history += " " + " ".join(f"t{conv}y{turn}z{i}" for i in range(12))
            resp = fakes.completion(router, history)
            assert resp.status_code == 200
            homes.setdefault(conv, set()).add(resp.headers["x-kvserve-endpoint"])
    assert all(len(urls) == 1 for urls in homes.values()), homes  # every turn found its history
    # Unrelated first turns tie and are spread at random (seeded).
    assert len({u for urls in homes.values() for u in urls}) >= 2
    prefix_routed = sum(
        router.metric("kvserve_router:requests_total", replica=x.url, reason="prefix") for x in replicas
    )
    assert prefix_routed == 18  # turns 2-4 of 6 conversations
    assert router.in_flight() == 0  # waits for the last release
    assert all(r.in_flight_prefill_tokens == 0 for r in router.router.replicas.replicas.values())


def test_models_health_metrics_and_bad_json(fakes):
    (a,) = fakes("a")
    router = fakes.router([a.url])
    assert httpx.get(router.url + "/v1/models").json()["data"][0]["owned_by"] == "a"
    assert httpx.get(router.url + "/health").json() == {"status": "ok", "replicas": 1, "routable": 1}
    resp = httpx.post(router.url + "/v1/completions", content=b"{not json", timeout=5)
    assert resp.status_code == 400 and "not valid JSON" in resp.json()["error"]["message"]
    router.poll()
    assert router.router.replicas.capacity_blocks(router.router.replicas.replicas[a.url]) == 4096 // 4
    text = httpx.get(router.url + "/metrics").text
    assert "kvserve_router:replicas" in text and "kvserve_router:decision_seconds" in text


def test_when_every_attempt_fails_an_ejected_replica_that_is_back_takes_the_request(fakes):
    """The only ranked replica refuses the connection while the other, healthy again, still sits out a long
    ejection back-off (a restarted replica in a rolling restart): the router re-probes ejected replicas once and
    sends the request there instead of answering 502."""
    (b,) = fakes("b")
    dead = fakes.dead_url()
    router = fakes.router([dead, b.url], eject_base_s=30)
    router.router.replicas.eject(b.url, time.monotonic(), "restarting")  # back-off of 30 s: not probed by polls
    resp = fakes.completion(router, "p0")
    assert resp.status_code == 200 and resp.headers["x-kvserve-endpoint"] == b.url
    assert router.router.replicas.replicas[b.url].ejected_until is None
    assert router.router.replicas.replicas[dead].ejected_until is not None

"""Requests held while no replica is ready (scale from zero): the queue itself (pure asyncio), then the proxy
against fake replicas that start after the requests arrived, the timeout, a full queue and a client leaving."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from kvserve.runtime.router.hold import HeldRequests, HoldRejected

pytestmark = pytest.mark.timeout(60)


# ---- the queue ------------------------------------------------------------------------------------------------
def test_release_wakes_waiters_oldest_first_across_models():
    async def scenario():
        changes: list[int] = []
        held = HeldRequests(max_per_model=4, timeout_s=5, on_change=changes.append)
        order: list[str] = []

        async def one(tag: str, model: str):
            await held.wait(model, time.monotonic() + 5)
            order.append(tag)

        tasks = []
        for tag, model in [("a1", "a"), ("b1", "b"), ("a2", "a"), ("b2", "b"), ("a3", "a")]:
            tasks.append(asyncio.create_task(one(tag, model)))
            await asyncio.sleep(0)  # each reaches wait() before the next starts
        assert held.counts() == {"a": 3, "b": 2} and len(held) == 5
        assert held.release() == 5
        await asyncio.gather(*tasks)
        return order, changes, held.counts()

    order, changes, counts = asyncio.run(scenario())
    assert order == ["a1", "b1", "a2", "b2", "a3"]
    assert changes == [1, 2, 3, 4, 5, 0] and counts == {}


def test_limit_is_per_model_and_timeout_and_cancel_free_the_slot():
    async def scenario():
        held = HeldRequests(max_per_model=1, timeout_s=0.2)
        first = asyncio.create_task(held.wait("a", time.monotonic() + 0.2))
        await asyncio.sleep(0)
        with pytest.raises(HoldRejected) as full:
            await held.wait("a", time.monotonic() + 1)
        other = asyncio.create_task(held.wait("b", time.monotonic() + 5))  # another model has its own limit
        await asyncio.sleep(0)
        assert held.counts() == {"a": 1, "b": 1}
        with pytest.raises(HoldRejected) as late:
            await first
        other.cancel()  # the client left
        await asyncio.gather(other, return_exceptions=True)
        ready_now = await held.wait("c", time.monotonic() + 5, ready=lambda: True)  # a replica is already ready
        return full.value.reason, late.value.reason, held.counts(), ready_now

    full, late, counts, ready_now = asyncio.run(scenario())
    assert (full, late, counts, ready_now) == ("queue_full", "hold_timeout", {}, 0.0)


def test_distinct_models_are_bounded():
    async def scenario():
        held = HeldRequests(max_per_model=8, timeout_s=5, max_models=2)
        tasks = [asyncio.create_task(held.wait(m, time.monotonic() + 5)) for m in ("a", "b")]
        await asyncio.sleep(0)
        with pytest.raises(HoldRejected) as info:
            await held.wait("c", time.monotonic() + 5)
        held.release()
        await asyncio.gather(*tasks)
        return info.value.reason

    assert asyncio.run(scenario()) == "too_many_models"


# ---- the proxy ------------------------------------------------------------------------------------------------
def _post(router, results: dict, key: str, model: str = "m", stream: bool = True) -> threading.Thread:
    def run():
        results[key] = httpx.post(
            router.url + "/v1/completions", json={"model": model, "prompt": key, "stream": stream}, timeout=30
        )

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _wait_held(router, n: int) -> None:
    deadline = time.monotonic() + 10
    while router.metric("kvserve_router:held_requests") != n:
        assert time.monotonic() < deadline, f"held {router.metric('kvserve_router:held_requests')}, want {n}"
        time.sleep(0.02)


def test_requests_held_at_zero_replicas_are_forwarded_once_one_is_ready(fakes):
    port_url = fakes.dead_url()  # the replica's address; nothing listens there yet
    router = fakes.router([port_url], max_held_requests=8, hold_timeout_s=20, poll_interval_s=0.1)
    results: dict = {}
    threads = [_post(router, results, f"p{i}", stream=i % 2 == 0) for i in range(4)]
    _wait_held(router, 4)
    health = httpx.get(router.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "holding" and health.json()["held"] == 4
    assert "kvserve_router:held_requests 4.0" in httpx.get(router.url + "/metrics").text
    time.sleep(0.5)  # still held: nothing is answered while no replica is ready
    assert not results
    replica = fakes.later("a", int(port_url.rsplit(":", 1)[1]))
    for t in threads:
        t.join(30)
    assert sorted(r["prompt"] for r in replica.received) == ["p0", "p1", "p2", "p3"]
    for i in range(4):
        resp = results[f"p{i}"]
        assert resp.status_code == 200 and resp.headers["x-kvserve-endpoint"] == replica.url
        assert resp.text.rstrip().endswith("data: [DONE]")  # the whole stream, as if never held
    assert router.metric("kvserve_router:held_requests") == 0
    assert router.metric("kvserve_router:hold_outcomes_total", outcome="forwarded") == 4
    assert router.metric("kvserve_router:hold_seconds_count") == 4 and router.in_flight() == 0


def test_hold_timeout_and_full_queue_answer_503_with_retry_after(fakes):
    router = fakes.router(
        [fakes.dead_url()], max_held_requests=2, hold_timeout_s=1.0, hold_retry_after_s=7, poll_interval_s=0.1
    )
    results: dict = {}
    threads = [_post(router, results, f"p{i}") for i in range(2)]
    _wait_held(router, 2)
    started = time.monotonic()
    full = httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10)
    assert time.monotonic() - started < 0.5  # refused at once, not after the timeout
    assert full.status_code == 503 and full.headers["retry-after"] == "7"
    assert full.json()["error"]["code"] == "queue_full" and full.json()["error"]["type"] == "server_error"
    assert "--max-held-requests" in full.json()["error"]["message"]
    for t in threads:
        t.join(10)
    for i in range(2):
        resp = results[f"p{i}"]
        assert resp.status_code == 503 and resp.headers["retry-after"] == "7"
        assert resp.json()["error"]["code"] == "hold_timeout"
    assert router.metric("kvserve_router:hold_outcomes_total", outcome="hold_timeout") == 2
    assert router.metric("kvserve_router:hold_outcomes_total", outcome="queue_full") == 1
    assert router.metric("kvserve_router:held_requests") == 0


def test_a_client_leaving_while_held_frees_its_slot(fakes):
    router = fakes.router([fakes.dead_url()], max_held_requests=1, hold_timeout_s=20, poll_interval_s=0.1)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=0.5)
    deadline = time.monotonic() + 5
    while router.metric("kvserve_router:hold_outcomes_total", outcome="client_gone") != 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert router.metric("kvserve_router:held_requests") == 0


def test_without_holding_no_ready_replica_fails_at_once(fakes):
    router = fakes.router([fakes.dead_url()], poll_interval_s=0.1)
    started = time.monotonic()
    resp = httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10)
    assert resp.status_code == 502 and time.monotonic() - started < 2

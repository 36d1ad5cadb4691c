"""A rolling restart under steady streaming load loses nothing (issue 29), for a client that never retries.

Two real `kvserve serve` replicas (the demo model, each its own process group) restart one after the other
while client threads stream completions without pause, half of them straight to the replicas (round robin
over an emulated Service's endpoint list: a Kubernetes Service or a gateway without retries) and half through
`kvserve router` (static backends). The stop is what a kubelet does with a pod that has no preStop hook, and
the Service behaves as Kubernetes does: SIGTERM to the server's process group at t0; the endpoint is taken
out of the Service only PROPAGATION_S later (endpoint removal propagates for seconds while traffic still
arrives); the replacement comes up on the same port and rejoins the Service once /health is 200.

The replicas run with --drain-accept-seconds ACCEPT_S > PROPAGATION_S: they keep accepting new requests while
/health is 503, so nothing is sent into a 503 while the endpoint is still listed; the router sees the stop in
the replica's /metrics (kvserve:draining) and stops sending there first. With today's defaults minus the
accept window (--drain-accept-seconds 0) the direct clients get 503s in that gap: the test checks that
requests really started on a stopping replica while it was still listed, so the window is exercised.

Every request must answer 200 with every token and [DONE]; every stopped replica must exit 0.
Only 127.0.0.1; bounded in count and time.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.router.conftest import LiveRouter
from tests.server.conftest import free_port
from tests.server.serve_process import GroupServer

pytestmark = pytest.mark.timeout(240)

PROPAGATION_S = 1.0  # SIGTERM -> endpoint removed from the Service
ACCEPT_S = 2.5  # the replicas keep accepting this long after SIGTERM
MAX_TOKENS = 12
DIRECT_CLIENTS, ROUTED_CLIENTS = 2, 2
MAX_REQUESTS = 2000  # a bound, far above what the restart takes


class Service:
    """The endpoint list a kube-proxy / gateway without retries would use: round robin over what is listed."""

    def __init__(self, urls: list[str]):
        self.urls = list(urls)
        self.lock = threading.Lock()
        self.counter = itertools.count()

    def pick(self) -> str:
        with self.lock:
            return self.urls[next(self.counter) % len(self.urls)]

    def remove(self, url: str) -> None:
        with self.lock:
            self.urls.remove(url)

    def add(self, url: str) -> None:
        with self.lock:
            self.urls.append(url)


def stream_once(url: str) -> str | None:
    """One streaming completion; None when it came back whole, else what went wrong (no retry)."""
    body = {"prompt": "Hello", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
            if resp.status_code != 200:
                return f"{url}: HTTP {resp.status_code} {resp.read()[:200]!r}"
            finish, usage, done = None, None, False
            for line in resp.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return f"{url}: error event {chunk['error']}"
                    for choice in chunk.get("choices", []):
                        finish = choice["finish_reason"] or finish
                    usage = chunk.get("usage") or usage
            if not done or finish != "length" or not usage or usage["completion_tokens"] != MAX_TOKENS:
                return f"{url}: incomplete stream (done={done}, finish={finish}, usage={usage})"
    except httpx.HTTPError as err:
        return f"{url}: {err!r}"
    return None


def test_rolling_restart_loses_nothing_direct_and_through_the_router(demo_model_dir):
    cache_dir = str(Path(demo_model_dir).parent)
    extra = ("--drain-accept-seconds", str(ACCEPT_S), "--drain-timeout", "30")
    ports = [free_port(), free_port()]
    replicas = [GroupServer(cache_dir, *extra, port=p, wait=False) for p in ports]
    router = None
    stop, failures, lock = threading.Event(), [], threading.Lock()
    counts = {"direct": 0, "routed": 0, "direct_to_stopping": 0}
    stopping: set[str] = set()
    try:
        for replica in replicas:
            replica.wait_healthy()
        urls = [r.base_url for r in replicas]
        service = Service(urls)
        router = LiveRouter(urls, poll_interval_s=0.2)

        def client(kind: str) -> None:
            while not stop.is_set():
                with lock:
                    if counts["direct"] + counts["routed"] >= MAX_REQUESTS:
                        return
                url = service.pick() if kind == "direct" else router.url
                to_stopping = url in stopping
                error = stream_once(url)
                with lock:
                    counts[kind] += 1
                    counts["direct_to_stopping"] += to_stopping
                    if error is not None:
                        failures.append(f"{kind}: {error}")

        threads = [threading.Thread(target=client, args=("direct",), daemon=True) for _ in range(DIRECT_CLIENTS)]
        threads += [threading.Thread(target=client, args=("routed",), daemon=True) for _ in range(ROUTED_CLIENTS)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # steady load first
        for i, old in enumerate(list(replicas)):
            stopping.add(old.base_url)
            removal = threading.Timer(PROPAGATION_S, service.remove, args=(old.base_url,))
            old_group = old.pgid
            signal_sent = time.monotonic()
            os.killpg(old_group, signal.SIGTERM)  # the kubelet: no preStop hook here
            removal.start()
            code = old.proc.wait(90)
            assert code == 0, "".join(old.log)
            assert time.monotonic() - signal_sent >= ACCEPT_S
            removal.join()
            stopping.discard(old.base_url)
            new = GroupServer(cache_dir, *extra, port=old.port)  # the replacement pod, same address
            replicas[i] = new
            service.add(new.base_url)
            time.sleep(1.0)  # traffic on the new replica before the next one stops
        stop.set()
        for t in threads:
            t.join(90)
        assert not any(t.is_alive() for t in threads)
        assert failures == [], failures[:5]
        assert counts["direct"] >= 10 and counts["routed"] >= 10, counts
        # the accept window was exercised: requests started on a stopped replica while it was still listed
        assert counts["direct_to_stopping"] >= 1, counts
    finally:
        stop.set()
        if router is not None:
            router.stop()
        for replica in replicas:
            replica.kill()

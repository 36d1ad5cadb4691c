"""Sleep mode with `kvserve serve --api-server-count 2` (issue 43): a /sleep sent to one API server puts every
API server to sleep (each answers /health 503 "sleeping", /is_sleeping true, and refuses completions with 503 +
Retry-After), and a /wake_up sent to any of them wakes them all, serving the same greedy text as before. The
core's SLEEP_STATE message reaches each server (engine/core_utilities.py); an idle server reads it within its
0.5 s poll. Which server answers is the kernel's choice (SO_REUSEPORT): each check polls fresh connections until
both servers (x-kvserve-api-server) have answered it."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.server.test_api_server_count import complete, start_group

pytestmark = pytest.mark.timeout(300)

PROMPT = "The harbour town woke slowly."


def every_server(base_url: str, check, timeout_s: float = 30) -> None:
    """Poll fresh connections until both API servers have passed `check(response-getter)`; fail on a miss
    after a server already passed it, or when one never answers within timeout_s."""
    passed: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while passed != {"0", "1"}:
        assert time.monotonic() < deadline, f"only API servers {passed} passed"
        server, ok = check()
        if ok:
            passed.add(server)
        time.sleep(0.05)


def health(base_url: str):
    def check():
        r = httpx.get(base_url + "/health", timeout=5)
        return r.headers["x-kvserve-api-server"], r

    return check


def test_sleep_through_one_api_server_puts_every_one_to_sleep(demo_model_dir):
    from pathlib import Path

    group = start_group(str(Path(demo_model_dir).parent), "--enable-sleep-mode")
    url = group.base_url
    try:
        before = complete(url, PROMPT)[1]
        r = httpx.post(url + "/sleep", params={"level": 1}, timeout=60)
        assert r.status_code == 200, r.text
        sleeper = r.headers["x-kvserve-api-server"]

        def asleep():
            server, resp = health(url)()
            return server, resp.status_code == 503 and resp.json() == {"status": "sleeping"}

        def says_sleeping():
            resp = httpx.get(url + "/is_sleeping", timeout=5)
            return resp.headers["x-kvserve-api-server"], resp.json() == {"is_sleeping": True}

        def refuses():
            resp = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
            return resp.headers["x-kvserve-api-server"], resp.status_code == 503 and "Retry-After" in resp.headers

        for check in (asleep, says_sleeping, refuses):
            every_server(url, check)
        # Wake through the other server where the kernel lets us reach it first; any server wakes them all.
        deadline = time.monotonic() + 10
        while True:
            r = httpx.post(url + "/wake_up", timeout=120)
            assert r.status_code == 200, r.text
            if r.headers["x-kvserve-api-server"] != sleeper or time.monotonic() > deadline:
                break

        def awake():
            server, resp = health(url)()
            return server, resp.status_code == 200

        every_server(url, awake)
        seen = {}
        deadline = time.monotonic() + 30
        while set(seen) != {"0", "1"} and time.monotonic() < deadline:
            server, text = complete(url, PROMPT)
            seen[server] = text
        assert set(seen) == {"0", "1"} and set(seen.values()) == {before}, (seen, before)
    finally:
        group.kill()

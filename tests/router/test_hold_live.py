"""Scale from zero end to end on 127.0.0.1, with real processes: `kvserve router --max-held-requests` starts
with no replica up, requests arrive and are held, a real `kvserve serve` (stories260K) is started seconds
later, and every held request -- streamed and not, chat and completions -- is answered with the same text the
replica gives when asked directly; nothing is lost. Held for at least HOLD_S (40 s: the issue's streaming
case) so no idle timeout on the way cuts a long-held stream. Then the timeout path through the CLI's flags."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.router.conftest import STORIES_DIR, free_port

pytestmark = pytest.mark.timeout(420)
HOLD_S = 40.0  # the replica is started only after the first request has been held this long


class _Process:
    def __init__(self, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()

    def wait_http(self, url: str, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "exited early:\n" + "".join(self.log)
            try:
                if httpx.get(url, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"{url} never answered 200:\n" + "".join(self.log))

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


def _text(resp: httpx.Response, chat: bool, stream: bool) -> str:
    if not stream:
        choice = resp.json()["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]
    events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
    assert resp.text.rstrip().endswith("data: [DONE]")
    key = (lambda c: c["delta"].get("content") or "") if chat else (lambda c: c["text"])
    return "".join(key(e["choices"][0]) for e in events if e.get("choices"))


REQUESTS = [
    (path, stream, body)
    for i in range(3)
    for path, body in [
        ("/v1/completions", {"prompt": f"Once upon a time, number {i},"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"Tell me story {i}."}]}),
    ]
    for stream in (False, True)
]


def test_router_holds_requests_until_a_replica_starts_then_answers_them_all():
    replica_port, router_port = free_port(), free_port()
    replica_url, router_url = f"http://127.0.0.1:{replica_port}", f"http://127.0.0.1:{router_port}"
    router = _Process(
        "router",
        "--backend",
        replica_url,
        "--host",
        "127.0.0.1",
        "--port",
        str(router_port),
        "--max-held-requests",
        "32",
        "--hold-timeout",
        "280",
        "--poll-interval",
        "0.2",
    )
    replica = None
    try:
        router.wait_http(router_url + "/health")  # a holding router is ready with no replica
        results: dict[int, httpx.Response] = {}
        held_s: dict[int, float] = {}

        def send(i: int, path: str, stream: bool, body: dict) -> None:
            payload = {**body, "model": "stories", "max_tokens": 12, "temperature": 0, "stream": stream}
            sent = time.monotonic()
            results[i] = httpx.post(router_url + path, json=payload, timeout=300)
            held_s[i] = time.monotonic() - sent

        threads = []
        first_sent = time.monotonic()
        for i, (path, stream, body) in enumerate(REQUESTS):
            threads.append(threading.Thread(target=send, args=(i, path, stream, body)))
            threads[-1].start()
            time.sleep(0.05)
        deadline = time.monotonic() + 30
        while f"kvserve_router:held_requests {len(REQUESTS)}.0" not in httpx.get(router_url + "/metrics").text:
            assert time.monotonic() < deadline, httpx.get(router_url + "/metrics").text
            time.sleep(0.1)
        time.sleep(max(0.0, first_sent + HOLD_S - time.monotonic()))  # the replica starts HOLD_S later
        assert not results
        held_at = time.monotonic()
        replica = _Process(
            "serve",
            str(STORIES_DIR),
            "--host",
            "127.0.0.1",
            "--port",
            str(replica_port),
            "--served-model-name",
            "stories",
            "--kv-cache-bytes",
            "8MiB",
            "--max-model-len",
            "256",
        )
        for t in threads:
            t.join(300)
        waited_s = time.monotonic() - held_at
        assert sorted(results) == list(range(len(REQUESTS))), "a request was lost"
        assert min(held_s.values()) >= HOLD_S - 1, held_s  # every one (streams too) waited about HOLD_S or more
        for i, (path, stream, body) in enumerate(REQUESTS):
            resp = results[i]
            assert resp.status_code == 200, (resp.text, "".join(replica.log)[-3000:])
            assert resp.headers["x-kvserve-endpoint"] == replica_url
            payload = {**body, "model": "stories", "max_tokens": 12, "temperature": 0, "stream": stream}
            direct = httpx.post(replica_url + path, json=payload, timeout=60)
            chat = "chat" in path
            assert _text(resp, chat, stream) == _text(direct, chat, stream) != ""
        metrics = httpx.get(router_url + "/metrics").text
        assert "kvserve_router:held_requests 0.0" in metrics
        assert f'kvserve_router:hold_outcomes_total{{outcome="forwarded"}} {len(REQUESTS)}.0' in metrics
        print(f"{len(REQUESTS)} held requests answered {waited_s:.1f} s after the replica was started")
    finally:
        if replica is not None:
            replica.stop()
        router.stop()


def test_cli_hold_timeout_and_full_queue_answer_503_with_retry_after():
    """The timeout path through `kvserve router`'s own flags: with no replica ever ready, a held request gets
    503 + Retry-After once --hold-timeout passes, and one past --max-held-requests gets it at once."""
    router_port = free_port()
    router_url = f"http://127.0.0.1:{router_port}"
    router = _Process(
        "router",
        "--backend",
        f"http://127.0.0.1:{free_port()}",  # nothing listens there
        "--host",
        "127.0.0.1",
        "--port",
        str(router_port),
        "--max-held-requests",
        "1",
        "--hold-timeout",
        "3",
        "--hold-retry-after",
        "9",
        "--poll-interval",
        "0.2",
    )
    try:
        router.wait_http(router_url + "/health")
        body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 4}
        held: dict[str, object] = {}

        def send() -> None:
            sent = time.monotonic()
            held["resp"] = httpx.post(router_url + "/v1/completions", json=body, timeout=30)
            held["s"] = time.monotonic() - sent

        thread = threading.Thread(target=send)
        thread.start()
        deadline = time.monotonic() + 20
        while "kvserve_router:held_requests 1.0" not in httpx.get(router_url + "/metrics").text:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        full = httpx.post(router_url + "/v1/completions", json=body, timeout=30)
        assert full.status_code == 503 and full.headers["retry-after"] == "9"
        assert full.json()["error"]["code"] == "queue_full"
        thread.join(30)
        resp = held["resp"]
        assert resp.status_code == 503 and resp.headers["retry-after"] == "9", resp.text
        assert resp.json()["error"]["code"] == "hold_timeout" and held["s"] >= 3
        metrics = httpx.get(router_url + "/metrics").text
        assert 'kvserve_router:hold_outcomes_total{outcome="hold_timeout"} 1.0' in metrics
        assert 'kvserve_router:hold_outcomes_total{outcome="queue_full"} 1.0' in metrics
        assert "kvserve_router:held_requests 0.0" in metrics
    finally:
        router.stop()

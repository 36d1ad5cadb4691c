"""`kvserve serve --api-server-count 2` (runtime/server/api_server_group.py): two API-server processes on one
port in front of one engine core.

- requests through the shared port are answered by both servers (x-kvserve-api-server header), and greedy
  texts equal a single server's (the `server` fixture: one API server, its core in its own process);
- /metrics from either server shows the group's sums: vllm:request_success_total counts every request
  once, the core's token counters are not multiplied by the number of servers, the waiting gauge sees the
  queue and returns to 0; the metric families are the single server's;
- SIGTERM drains both servers (streams finish, new requests 503) and the group exits 0;
- SIGKILL of the core: 503 engine_dead from the servers, /health 503, exit 1; SIGKILL of one API server:
  the group stops with exit 1. No process is left (conftest's no_orphan_processes).
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.server.test_drain import ServeProcess
from tests.server.test_metrics_and_load import scrape

pytestmark = pytest.mark.timeout(240)

# The `server` fixture's engine settings (conftest.DEMO_ENGINE_KWARGS), except 4 seats so a queue forms.
GROUP_FLAGS = ("--api-server-count", "2", "--max-num-seqs", "4", "--max-num-batched-tokens", "1024", "--seed", "0")


def wait_all_healthy(base_url: str, count: int, timeout_s: float = 120) -> None:
    """ServeProcess returns at the first 200; here every server must answer 200 (fresh connections)."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while len(seen) < count:
        assert time.monotonic() < deadline, f"only API servers {seen} became healthy"
        try:
            resp = httpx.get(base_url + "/health", timeout=2)
            if resp.status_code == 200:
                seen.add(resp.headers["x-kvserve-api-server"])
        except httpx.HTTPError:
            pass
        time.sleep(0.02)


def start_group(cache_dir: str, *extra: str) -> ServeProcess:
    group = ServeProcess(cache_dir, *GROUP_FLAGS, *extra)
    try:
        wait_all_healthy(group.base_url, 2)
    except BaseException:
        group.kill()
        raise
    return group


def logged_pid(group: ServeProcess, pattern: str) -> int:
    match = re.search(pattern, "".join(group.log))
    assert match, "".join(group.log)
    return int(match.group(1))


def complete(base_url: str, prompt: str, max_tokens: int = 12) -> tuple[str, str]:
    """(answering server index, text) of a greedy completion on a fresh connection."""
    resp = httpx.post(
        base_url + "/v1/completions",
        timeout=60,
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    )
    assert resp.status_code == 200, resp.text
    return resp.headers.get("x-kvserve-api-server", "-"), resp.json()["choices"][0]["text"]


def success_total(base_url: str) -> tuple[str, dict]:
    resp = httpx.get(base_url + "/metrics", timeout=10)
    from prometheus_client.parser import text_string_to_metric_families

    values: dict = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return resp.headers["x-kvserve-api-server"], values


@pytest.fixture(scope="module")
def cache_dir(demo_model_dir) -> str:
    return str(Path(demo_model_dir).parent)  # the demo model is already built there


@pytest.fixture(scope="module")
def group(cache_dir):
    group = start_group(cache_dir, "--drain-timeout", "60")
    yield group
    group.kill()


def test_api_server_count_is_refused_outside_kvserve_serve():
    from kvserve.runtime.config import make_engine_config
    from kvserve.runtime.errors import InvalidParameter

    with pytest.raises(InvalidParameter) as err:
        make_engine_config("/nonexistent-model", api_server_count=2)  # refused before the model is read
    assert err.value.param == "api_server_count" and "kvserve serve" in str(err.value)


def test_both_servers_answer_and_greedy_texts_equal_one_server(group, server):
    prompts = [f"story number {i} begins" for i in range(40)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: complete(group.base_url, p), prompts))
        single = list(pool.map(lambda p: complete(server.base_url, p)[1], prompts))
    by_server = {index: sum(1 for i, _ in answers if i == index) for index in ("0", "1")}
    assert by_server["0"] > 0 and by_server["1"] > 0 and sum(by_server.values()) == len(prompts), by_server
    assert [text for _, text in answers] == single


def test_metrics_are_the_group_sums_from_either_server(group, server):
    _, before = success_total(group.base_url)
    sent, max_tokens = 24, 30
    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(complete, group.base_url, f"count {i}", max_tokens) for i in range(sent)]
        waiting_seen = 0.0
        while not all(f.done() for f in futures):  # 12 at once, 4 seats: a queue forms across both servers
            waiting_seen = max(waiting_seen, success_total(group.base_url)[1]["vllm:num_requests_waiting"])
            time.sleep(0.05)
        assert {f.result()[0] for f in futures} == {"0", "1"}
    assert waiting_seen > 0
    expected = {
        "vllm:request_success_total": sent,
        "vllm:generation_tokens_total": sent * max_tokens,
        "vllm:request_generation_tokens_sum": sent * max_tokens,
        "vllm:e2e_request_latency_seconds_count": sent,
    }
    scraped_by: set[str] = set()
    deadline = time.monotonic() + 20
    while True:  # the core's counters reach server 0 with the core's next stats (at most ~0.5 s when idle)
        index, after = success_total(group.base_url)
        got = {name: after[name] - before.get(name, 0.0) for name in expected}
        done = got == expected and after["vllm:num_requests_waiting"] == 0 and after["vllm:num_requests_running"] == 0
        if done:
            scraped_by.add(index)
        if scraped_by == {"0", "1"} or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert scraped_by == {"0", "1"}, (got, after)
    assert after["vllm:prompt_tokens_total"] - before.get("vllm:prompt_tokens_total", 0) == after[
        "vllm:request_prompt_tokens_sum"
    ] - before.get("vllm:request_prompt_tokens_sum", 0)
    assert after["kvserve:healthy"] == 1 and after["kvserve:engine_alive"] == 1
    assert after["kvserve:num_kv_blocks_free"] == after["kvserve:num_kv_blocks_total"] > 0
    # The same series families as one server (a labelled family with no series yet, e.g.
    # kvserve:http_requests_rejected, is exposed empty by one process and not at all in multiprocess mode).
    assert {name for name, samples in scrape(group.base_url).items() if samples} == {
        name for name, samples in scrape(server.base_url).items() if samples
    }


def _stream(base_url: str, started: threading.Event, result: dict, max_tokens: int) -> None:
    body = {"prompt": "Keep talking", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    finish, chunks = None, 0
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as resp:
        result["server"] = resp.headers.get("x-kvserve-api-server")
        result["status"] = resp.status_code
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                chunks += 1
                for choice in chunk.get("choices", []):
                    finish = choice["finish_reason"] or finish
                started.set()
    result.update(finish=finish, chunks=chunks)


def start_streams(base_url: str, count: int, max_tokens: int = 1000) -> tuple[list[threading.Thread], list[dict]]:
    """At least `count` streams, and more until both servers hold one (connections are spread by a hash).
    max_tokens 1000: long enough to outlast the SIGTERM test's probing on a fast box (~3-4 ms per token here;
    with 300 tokens both servers could finish their drains, and close the port, before both were seen
    refusing), short enough to drain."""
    threads, results = [], []
    while len(threads) < count or ({r["server"] for r in results} != {"0", "1"} and len(threads) < 4 * count):
        started, result = threading.Event(), {}
        t = threading.Thread(target=_stream, args=(base_url, started, result, max_tokens), daemon=True)
        t.start()
        assert started.wait(60), "stream never started"
        threads.append(t)
        results.append(result)
    assert {r["server"] for r in results} == {"0", "1"}, results
    return threads, results


def test_sigterm_drains_both_servers_and_exits_0(group):
    threads, results = start_streams(group.base_url, 4)  # both servers hold streams: both drain for a while
    group.proc.send_signal(signal.SIGTERM)
    refused: set[str] = set()
    deadline = time.monotonic() + 10
    while refused != {"0", "1"} and time.monotonic() < deadline:  # both servers drain: 503 for new work
        resp = httpx.post(group.base_url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10)
        if resp.status_code == 503:
            refused.add(resp.headers["x-kvserve-api-server"])
        time.sleep(0.02)
    assert refused == {"0", "1"}
    for t in threads:
        t.join(120)
    assert all(r["status"] == 200 and r["finish"] == "length" for r in results), results
    assert group.proc.wait(60) == 0, "".join(group.log)


def test_sigkill_of_the_core_answers_503_and_the_group_exits_1(cache_dir):
    # Room for up to 8 streams of 6000 tokens, all running at once (none queues, none is preempted).
    group = start_group(cache_dir, "--max-num-seqs", "16", "--max-model-len", "8192", "--kv-cache-bytes", "512MiB")
    try:
        core = logged_pid(group, r"engine core process (\d+) started")
        # 6000 tokens: no stream may finish before the kill, however long the starts take -- a 1000-token
        # stream once did, in a CI-like run where 4 starts took over 3 s.
        threads, results = start_streams(group.base_url, 2, max_tokens=6000)
        os.kill(core, signal.SIGKILL)
        statuses: dict[str, set[int]] = {"0": set(), "1": set()}
        health: list[int] = []
        while group.proc.poll() is None:
            try:
                resp = httpx.post(group.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=5)
                statuses[resp.headers["x-kvserve-api-server"]].add(resp.status_code)
                if resp.status_code == 503:
                    assert "engine is dead" in resp.json()["error"]["message"], resp.text
                health.append(httpx.get(group.base_url + "/health", timeout=5).status_code)
            except httpx.HTTPError:  # a server that has exited
                pass
            time.sleep(0.02)
        assert group.proc.wait(30) == 1, "".join(group.log)
        for t in threads:
            t.join(15)
        assert all(r["finish"] != "length" for r in results), results
        assert 503 in statuses["0"] | statuses["1"] and 503 in health, (statuses, health)
        assert "the engine core process died (killed by SIGKILL)" in "".join(group.log)
    finally:
        group.kill()


def test_a_core_that_cannot_start_fails_the_group_with_the_plan_rejection(cache_dir, tmp_path):
    """The launcher hears the core's STARTUP_FAILED itself and writes the termination message last."""
    import subprocess
    import sys

    from kvserve.runtime.server.termination import PLAN_REJECTED_PREFIX
    from tests.server.conftest import free_port

    env = {**os.environ, "KVSERVE_CACHE_DIR": cache_dir, "KVSERVE_TERMINATION_LOG": str(tmp_path / "termination")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvserve.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(free_port()),
            "--max-model-len",
            "2048",
            "--kv-cache-bytes",
            "1KiB",
            "--api-server-count",
            "2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1, log
    message = (tmp_path / "termination").read_text()
    assert message.startswith(PLAN_REJECTED_PREFIX) and "kv_cache_bytes" in message, message
    assert "kvserve.server.group: " + PLAN_REJECTED_PREFIX in log, log


def test_sigkill_of_one_api_server_stops_the_group_with_exit_1(cache_dir):
    group = start_group(cache_dir, "--drain-timeout", "5")
    try:
        victim = logged_pid(group, r"API server 1: pid (\d+)")
        os.kill(victim, signal.SIGKILL)
        assert group.proc.wait(60) == 1, "".join(group.log)
        assert "kvserve-api-server-1 exited (killed by SIGKILL): stopping the other API servers" in "".join(group.log)
    finally:
        group.kill()

"""The signal matrix (issue 29): a real `kvserve serve` subprocess in its own session (start_new_session=True,
so it is a process group of its own, as under systemd, `timeout` or supervisord's killasgroup), one long
streaming completion in flight, then a stop:

- SIGTERM to the main process, SIGTERM to the whole process group (every helper process gets it too: the
  engine core, tensor-parallel workers, multiprocessing's forkserver / resource tracker), SIGINT to the group
  (Ctrl-C in a terminal): the stream completes whole (200, finish_reason "length", every token) and the
  server exits 0;
- a second SIGTERM to the group during the drain ("finish fast"): the stream is still answered (200, a
  final chunk with a finish_reason and [DONE], no error event) and the server exits 0.

TP=2 (gloo on CPU) and --api-server-count 2 run for the group SIGTERM only, to keep the matrix near a minute
on 2 busy cores. Only 127.0.0.1; every wait is bounded; the server is SIGKILLed (as a group) if it outlives
the test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import free_port

pytestmark = pytest.mark.timeout(150)

MAX_TOKENS = 600  # a few seconds of decoding on the demo model on a busy CPU: in flight at the signal


@pytest.fixture(scope="module")
def cache_dir(demo_model_dir) -> str:
    return str(Path(demo_model_dir).parent)  # the demo model (random weights) is already built there


class GroupServer:
    """`kvserve serve` (the demo model) as the leader of its own process group."""

    def __init__(self, cache_dir: str, *extra: str):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvserve.cli",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--kv-cache-bytes",
                "32MiB",
                "--max-model-len",
                "2048",
                "--drain-timeout",
                "60",
                *extra,
            ],
            env={**os.environ, "KVSERVE_CACHE_DIR": cache_dir},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.pgid = self.proc.pid  # start_new_session: the server leads its own group
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.kill()
                raise AssertionError("server exited early:\n" + "".join(self.log))
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill()
        raise AssertionError("server never became healthy:\n" + "".join(self.log))

    def kill(self) -> None:
        """SIGKILL the whole group (the server and anything it left), then reap the server."""
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


def stream(base_url: str, started: threading.Event, result: dict) -> None:
    body = {
        "prompt": "Keep talking",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    finish, usage, done, errors = None, None, False, []
    try:
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as resp:
            result["status"] = resp.status_code
            for line in resp.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        errors.append(chunk["error"])
                    for choice in chunk.get("choices", []):
                        finish = choice["finish_reason"] or finish
                        started.set()
                    usage = chunk.get("usage") or usage
                elif resp.status_code != 200 and line:
                    errors.append(line)
    except httpx.HTTPError as err:
        errors.append(repr(err))
    result.update(finish=finish, usage=usage, done=done, errors=errors)


def send(server: GroupServer, target: str, sig: signal.Signals) -> None:
    if target == "process":
        os.kill(server.proc.pid, sig)
    else:
        os.killpg(server.pgid, sig)


@pytest.mark.parametrize(
    "target,sig,second,extra",
    [
        pytest.param("process", signal.SIGTERM, False, (), id="sigterm-process"),
        pytest.param("group", signal.SIGTERM, False, (), id="sigterm-group"),
        pytest.param("group", signal.SIGINT, False, (), id="sigint-group"),
        pytest.param("group", signal.SIGTERM, True, (), id="sigterm-group-twice"),
        pytest.param("group", signal.SIGTERM, False, ("--tensor-parallel-size", "2"), id="sigterm-group-tp2"),
        pytest.param("group", signal.SIGTERM, False, ("--api-server-count", "2"), id="sigterm-group-2-api-servers"),
    ],
)
def test_stop_drains_in_flight_and_exits_0(cache_dir, target, sig, second, extra):
    server = GroupServer(cache_dir, *extra)
    try:
        started, result = threading.Event(), {}
        thread = threading.Thread(target=stream, args=(server.base_url, started, result), daemon=True)
        thread.start()
        assert started.wait(30), "the stream never started:\n" + "".join(server.log)
        time.sleep(0.2)  # a few tokens in
        send(server, target, sig)
        if second:
            time.sleep(0.5)
            send(server, target, signal.SIGTERM)
        thread.join(90)
        assert not thread.is_alive(), "the stream did not end:\n" + "".join(server.log)
        code = server.proc.wait(60)
        log = "".join(server.log)
        assert result.get("status") == 200 and not result["errors"] and result["done"], (result, log)
        if second:
            assert result["finish"] in ("abort", "length"), (result, log)
        else:
            assert result["finish"] == "length", (result, log)
            assert result["usage"]["completion_tokens"] == MAX_TOKENS, (result, log)
        assert code == 0, log
    finally:
        server.kill()

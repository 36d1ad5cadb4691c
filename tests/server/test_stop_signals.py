"""The signal matrix (issue 29): a real `kvserve serve` subprocess in its own session (start_new_session=True,
so it is a process group of its own, as under systemd, `timeout` or supervisord's killasgroup), one long
streaming completion in flight, then a stop:

- SIGTERM to the main process, SIGTERM to the whole process group (every helper process gets it too: the
  engine core, tensor-parallel workers, multiprocessing's forkserver / resource tracker), SIGTERM to every
  process of the server's tree one by one, children first (a cgroup stop: systemd's
  KillMode=control-group), SIGINT to the group (Ctrl-C in a terminal): the stream completes whole (200,
  finish_reason "length", every token) and the server exits 0;
- a second SIGTERM to the group during the drain ("finish fast"): the stream is still answered (200, a
  final chunk with a finish_reason and [DONE], no error event) and the server exits 0.

TP=2 (gloo on CPU) runs for the group SIGTERM only, --api-server-count 2 for the group and cgroup
SIGTERM, to keep the matrix near a minute on 2 busy cores. Only 127.0.0.1; every wait is bounded; the
server is SIGKILLed (as a group) if it outlives the test.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.serve_process import GroupServer

pytestmark = pytest.mark.timeout(150)

MAX_TOKENS = 600  # a few seconds of decoding on the demo model on a busy CPU: in flight at the signal


@pytest.fixture(scope="module")
def cache_dir(demo_model_dir) -> str:
    return str(Path(demo_model_dir).parent)  # the demo model (random weights) is already built there


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


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children's children too), from /proc: what a cgroup holds when nothing
    left it (a helper that called setsid() is still in the cgroup, though no longer in the process group)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def send(server: GroupServer, target: str, sig: signal.Signals) -> None:
    if target == "process":
        os.kill(server.proc.pid, sig)
    elif target == "cgroup":
        # systemd's KillMode=control-group, `docker stop` of an init-less container's processes, a pod's
        # cgroup: the signal reaches every process at once, in no order; children first here, the worst case.
        for pid in [*reversed(descendants(server.proc.pid)), server.proc.pid]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    else:
        os.killpg(server.pgid, sig)


@pytest.mark.parametrize(
    "target,sig,second,extra",
    [
        pytest.param("process", signal.SIGTERM, False, (), id="sigterm-process"),
        pytest.param("group", signal.SIGTERM, False, (), id="sigterm-group"),
        pytest.param("group", signal.SIGINT, False, (), id="sigint-group"),
        pytest.param("cgroup", signal.SIGTERM, False, (), id="sigterm-cgroup"),
        pytest.param("group", signal.SIGTERM, True, (), id="sigterm-group-twice"),
        pytest.param("group", signal.SIGTERM, False, ("--tensor-parallel-size", "2"), id="sigterm-group-tp2"),
        pytest.param("group", signal.SIGTERM, False, ("--api-server-count", "2"), id="sigterm-group-2-api-servers"),
        pytest.param("cgroup", signal.SIGTERM, False, ("--api-server-count", "2"), id="sigterm-cgroup-2-api-servers"),
        pytest.param(
            "cgroup", signal.SIGTERM, True, ("--api-server-count", "2"), id="sigterm-cgroup-twice-2-api-servers"
        ),
    ],
)
def test_stop_drains_in_flight_and_exits_0(cache_dir, target, sig, second, extra):
    server = GroupServer(cache_dir, *extra)
    try:
        started, result = threading.Event(), {}
        thread = threading.Thread(target=stream, args=(server.base_url, started, result), daemon=True)
        thread.start()
        assert started.wait(60), "the stream never started:\n" + "".join(server.log)
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


def test_cgroup_stop_while_api_servers_start_exits_0(cache_dir):
    """A cgroup stop that reaches the API servers while they are still importing (before uvicorn's handlers
    exist) waits, pending, for the drain handlers: nobody is killed by the signal and the group exits 0."""
    server = GroupServer(cache_dir, "--api-server-count", "2", wait=False)
    try:
        deadline = time.monotonic() + 60
        while not any("API server 1: pid" in line for line in server.log):
            assert time.monotonic() < deadline and server.proc.poll() is None, "".join(server.log)
            time.sleep(0.02)
        time.sleep(0.3)  # the servers are spawned and importing: the default action would kill them now
        send(server, "cgroup", signal.SIGTERM)
        code = server.proc.wait(90)
        log = "".join(server.log)
        assert "killed by" not in log, log
        assert code == 0, log
    finally:
        server.kill()

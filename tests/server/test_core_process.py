"""The engine core in its own process (runtime/engine/core_process.py): what crosses the boundary and how
failures surface on the API-server side.

- killing the core (SIGKILL) with requests running and queued: every one is answered with an error, /health
  turns 503 and `kvserve serve` exits 1, leaving no process behind;
- killing the API server: the core notices and leaves (no orphan);
- a client that disconnects mid-stream aborts its request in the core, whose blocks are freed;
- a script that builds a multi-process engine at module level without a `__main__` guard gets one clear error.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from tests.server.conftest import LiveServer, _live_descendants, make_engine
from tests.server.test_drain import ServeProcess, stream_completion

pytestmark = pytest.mark.timeout(180)


def _engine_core_pids(root_pid: int) -> list[int]:
    return [pid for pid, cmdline in _live_descendants(root_pid)]


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if os.path.exists(f"/proc/{pid}") and _state(pid) != "Z"]
        if not alive:
            return []
        time.sleep(0.05)
    return alive


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


# Long enough to outlast the test's set-up by far: the demo model streams 1,000 tokens in ~1.4 s on the 2-core VM
# (2026-12-05), and a stream that finished early would let the queued request run (the 2,048-token context of
# ServeProcess minus the prompt caps it).
STREAM_TOKENS = 2000


def test_killing_the_core_answers_every_request_with_an_error_and_exits_1(tmp_path):
    serve = ServeProcess(str(tmp_path), "--max-num-seqs", "2")
    try:
        cores = _engine_core_pids(serve.proc.pid)
        assert len(cores) == 1, f"expected one engine-core process below the server, found {cores}"
        results, threads = [], []
        for _ in range(2):  # running
            started, result = threading.Event(), {}
            t = threading.Thread(
                target=stream_completion, args=(serve.base_url, STREAM_TOKENS, started, result), daemon=True
            )
            t.start()
            assert started.wait(30)
            threads.append(t)
            results.append(result)
        queued: dict = {}

        def post_queued() -> None:
            resp = httpx.post(
                serve.base_url + "/v1/completions", json={"prompt": "queued", "max_tokens": 5}, timeout=30
            )
            queued.update(status=resp.status_code, body=resp.json())

        q = threading.Thread(target=post_queued, daemon=True)
        q.start()
        time.sleep(0.3)  # it waits behind the two running streams (max_num_seqs=2)

        # the scenario: both streams still running and the third request still waiting when the core dies
        assert all("text" not in r for r in results) and not queued, (results, queued)
        os.kill(cores[0], signal.SIGKILL)
        health = []
        deadline = time.monotonic() + 10
        while serve.proc.poll() is None and time.monotonic() < deadline:
            try:
                health.append(httpx.get(serve.base_url + "/health", timeout=1).status_code)
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        for t in threads + [q]:
            t.join(15)
        assert serve.proc.wait(15) == 1, "".join(serve.log)
        assert 503 in health and 200 not in health[health.index(503) :], health
        for result in results:  # the SSE streams end with an error event, not a normal finish
            assert result.get("finish") != "length", result
        assert queued["status"] == 503 and "engine is dead" in queued["body"]["error"]["message"], queued
        assert "engine core process died" in "".join(serve.log)
        assert not _wait_gone(cores, 5)
    finally:
        serve.kill()


def test_killing_the_api_server_takes_the_core_with_it(tmp_path):
    serve = ServeProcess(str(tmp_path))
    cores = _engine_core_pids(serve.proc.pid)
    assert cores
    serve.proc.kill()
    serve.proc.wait(10)
    assert not _wait_gone(cores, 10), "the engine core outlived its API server"


@pytest.fixture(scope="module")
def mp_server(demo_model_dir):
    srv = LiveServer(make_engine(demo_model_dir, max_num_seqs=4), model_dir=demo_model_dir, random_weights=True)
    yield srv
    srv.stop()


def test_client_disconnect_aborts_in_the_core_and_frees_its_blocks(mp_server):
    body = {
        "model": mp_server.model,
        "prompt": "a long story " * 40,
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", mp_server.base_url + "/v1/completions", json=body, timeout=30) as resp:
        chunks = 0
        for line in resp.iter_lines():
            chunks += line.startswith("data: ")
            if chunks >= 3:
                break
    running = mp_server.state.engine.stats
    stats = mp_server.wait_idle()
    assert stats.num_requests_running == 0 and stats.num_requests_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks, stats
    assert stats.generation_tokens < 1500, "the core generated the whole request after the client left"
    assert running is not None


def test_stop_strings_are_cut_in_the_api_server_and_the_core_stops(mp_server):
    """Stop strings are found by the API server; the core learns it (abort as stopped) and frees the sample."""
    client = mp_server.openai()
    first = client.completions.create(
        model=mp_server.model, prompt="once", max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    text = first.choices[0].text
    stop = text[10:13]
    assert len(stop) == 3 and stop.strip(), text
    cut = client.completions.create(
        model=mp_server.model, prompt="once", max_tokens=40, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[: text.index(stop)]
    stats = mp_server.wait_idle()
    assert stats.num_requests_running == 0 and stats.num_free_blocks == stats.num_total_blocks


UNGUARDED = """
from kvserve.runtime import LLM
llm = LLM(model={model!r}, tensor_parallel_size=2, kv_cache_bytes=8 << 20, max_model_len=256)
print("generated", llm.generate(["hi"], use_tqdm=False)[0].outputs[0].text)
"""


def test_an_unguarded_script_gets_one_clear_error(tmp_path, demo_model_dir):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(UNGUARDED.format(model=demo_model_dir)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=150, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert out.count('if __name__ == "__main__":') == 1, out
    assert "MainGuardError" in out and "bootstrapping phase" not in out, out

"""A tensor-parallel worker that dies or fails takes the engine to a clear error naming the rank -- never a
hang -- and every worker is reaped: offline (LLM.generate raises), and in `kvserve serve` (/health turns
503 engine_dead with a log line naming the rank, and the server exits 1)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.errors import InvalidParameter, WorkerDiedError

KW = dict(max_model_len=256, num_kv_blocks=128, max_num_seqs=8, tensor_parallel_size=2)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(120)
def test_worker_killed_mid_generate_raises_naming_the_rank(tp_model_factory):
    model_dir, _ = tp_model_factory("llama_gqa")
    llm = LLM(model_dir, **KW)
    try:
        executor = llm.engine.executor
        prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8]} for i in range(6)]
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        assert len(llm.generate(prompts[:1], SamplingParams(max_tokens=3), use_tqdm=False)) == 1
        victim = executor.worker_pids[1]
        threading.Timer(0.5, os.kill, (victim, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"rank 1 \(pid \d+\) .*(SIGKILL|not reachable)") as err:
            llm.generate(prompts, long, use_tqdm=False)
        assert time.monotonic() - start < 30  # noticed at once, not after a collective timeout
        assert err.value.rank == 1
        assert not any(_alive(pid) for pid in executor.worker_pids)  # rank 0 was stopped too
        with pytest.raises(WorkerDiedError, match="rank 1"):  # every later call fails the same way, at once
            llm.engine.check_health()
        with pytest.raises(WorkerDiedError):
            llm.generate(prompts[:1], long, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.shutdown()


@pytest.mark.timeout(120)
def test_worker_exception_is_fatal_and_named(tp_model_factory):
    model_dir, _ = tp_model_factory("llama_gqa")
    with LLM(model_dir, **KW) as llm:
        with pytest.raises(WorkerDiedError, match=r"rank [01] failed during a step: ValueError: unknown executor"):
            llm.engine.executor._call("no_such_method")
        with pytest.raises(WorkerDiedError):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    # a KV budget that cannot hold one sequence fails at startup with the field named, workers reaped
    with pytest.raises(InvalidParameter, match="^num_kv_blocks: .*max_model_len=256") as err:
        LLM(model_dir, **dict(KW, num_kv_blocks=4))
    assert err.value.param == "num_kv_blocks"


@pytest.mark.timeout(150)
def test_serve_health_turns_unhealthy_when_a_worker_dies(tp_model_factory):
    model_dir, _ = tp_model_factory("llama_gqa")
    from tests.server.conftest import free_port

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvserve.cli",
            "serve",
            model_dir,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--tensor-parallel-size",
            "2",
            "--max-model-len",
            "256",
            "--kv-cache-bytes",
            "1MiB",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, "server exited early:\n" + "".join(log)
            assert time.monotonic() < deadline, "server never became healthy:\n" + "".join(log)
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        resp = httpx.post(
            base + "/v1/completions",
            json={"model": model_dir, "prompt": "w5 w6 w7", "max_tokens": 4, "temperature": 0},
            timeout=30,
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 4
        match = re.search(r"started 2 gloo workers \(pids (\d+), (\d+)\)", "".join(log))
        assert match, "".join(log)
        pids = [int(match.group(1)), int(match.group(2))]
        os.kill(pids[1], signal.SIGKILL)  # rank 1, while the engine is idle
        # /health turns 503 engine_dead, then (nothing in flight to answer) the server exits 1 so that
        # Kubernetes restarts it; poll /health until the process is gone.
        saw_dead = False
        deadline = time.monotonic() + 20
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                resp = httpx.get(base + "/health", timeout=2)
                if resp.status_code == 503:
                    assert resp.json() == {"status": "engine_dead"}
                    saw_dead = True
            except httpx.HTTPError:
                pass  # already shutting down
            time.sleep(0.05)
        assert proc.wait(30) == 1, "server did not exit 1 after its worker died:\n" + "".join(log)
        text = "".join(log)
        assert saw_dead or "engine dead: exiting with status 1" in text, text
        assert re.search(r"ERROR .*tensor-parallel worker rank 1 \(pid \d+\) died \(killed by SIGKILL\)", text), text
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), "worker processes outlived the server"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)

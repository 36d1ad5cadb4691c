"""Issue 9 on a tensor-parallel server (`kvserve serve -tp 2`, gloo on CPU): the three reproductions answer
400 at once while an innocent request generates (it then equals its solo text) and no worker dies; a worker
that does die fails the in-flight request with a 503 at once and the server exits 1 (Kubernetes restarts it)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server.conftest import free_port
from tests.server.test_isolation import C, check_reproductions, no_python_repr, reproductions_next_to_innocent


class TPServer:
    def __init__(self, model_dir: str):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.model = model_dir
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvserve.cli",
                "serve",
                model_dir,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--tensor-parallel-size",
                "2",
                "--max-model-len",
                "512",
                "--kv-cache-bytes",
                "2MiB",
                "--max-num-seqs",
                "4",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()
        deadline = time.monotonic() + 90
        while True:
            assert self.proc.poll() is None, "server exited early:\n" + "".join(self.log)
            assert time.monotonic() < deadline, "server never became healthy:\n" + "".join(self.log)
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        match = re.search(r"started 2 gloo workers \(pids (\d+), (\d+)\)", "".join(self.log))
        assert match, "".join(self.log)
        self.worker_pids = [int(match.group(1)), int(match.group(2))]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in self.worker_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.timeout(180)
def test_tp2_reproductions_answer_400_then_a_dead_worker_ends_the_server(tp_model_factory):
    """One server (startup is the expensive part): first the reproductions next to an innocent request,
    then a worker killed under an in-flight request."""
    model_dir, _ = tp_model_factory("llama_gqa")
    srv = TPServer(model_dir)
    try:
        innocent = {"model": model_dir, "prompt": "w5 w6 w7", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
        solo = httpx.post(srv.base_url + C, json=innocent, timeout=120).json()["choices"][0]["text"]
        text, results = asyncio.run(reproductions_next_to_innocent(srv.base_url, innocent))
        check_reproductions(results)
        assert text == solo
        assert httpx.get(srv.base_url + "/health").status_code == 200
        assert srv.proc.poll() is None and "ERROR" not in "".join(srv.log), "".join(srv.log)

        async def kill_under_request() -> tuple[httpx.Response, float]:
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as client:
                pending = asyncio.ensure_future(client.post(C, json={**innocent, "max_tokens": 480}))
                await asyncio.sleep(1.0)
                assert not pending.done()
                os.kill(srv.worker_pids[1], signal.SIGKILL)
                start = time.monotonic()
                resp = await pending
                return resp, time.monotonic() - start

        resp, seconds = asyncio.run(kill_under_request())
        assert resp.status_code == 503 and seconds < 10, (resp.status_code, seconds)
        error = resp.json()["error"]
        assert error["code"] == "engine_dead" and no_python_repr(error["message"])
        assert "pid" not in error["message"]  # operators' details stay in the log
        assert srv.proc.wait(30) == 1, "".join(srv.log)
        assert re.search(r"tensor-parallel worker rank 1 \(pid \d+\) .*(SIGKILL|not reachable)", "".join(srv.log))
    finally:
        srv.stop()

"""Two "nodes" on 127.0.0.1 without Ray: `kvserve serve --nnodes 2 --node-rank 0` (API server, scheduler, pipeline
stage 0) and `kvserve serve --headless --node-rank 1` (stage 1) serve an OpenAI completion together; killing the
worker node fails the group within seconds (/health 503, the leader exits non-zero, no worker left)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _health_status(base: str) -> int | None:
    """/health's status code, or None when nothing listens any more (the leader exited between two polls)."""
    try:
        return httpx.get(f"{base}/health", timeout=2).status_code
    except httpx.ConnectError:
        return None


@pytest.mark.timeout(180)
def test_two_node_group_serves_and_fails_fast_when_the_worker_node_dies(tp_model_factory, tmp_path):
    from tests.server.conftest import free_port

    model_dir, _ = tp_model_factory("llama_gqa")  # 2 layers: one per node
    port, master_port = free_port(), free_port()
    common = [sys.executable, "-m", "kvserve.cli", "serve", model_dir, "--pipeline-parallel-size", "2"]
    common += ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(master_port)]
    common += ["--max-model-len", "256", "--num-kv-blocks", "64"]
    logs = {name: open(tmp_path / f"{name}.log", "w+") for name in ("leader", "worker")}
    # The worker node may start first: its ranks retry until the leader's executor listens.
    worker = subprocess.Popen(
        common + ["--node-rank", "1", "--headless"], stdout=logs["worker"], stderr=subprocess.STDOUT
    )
    leader = subprocess.Popen(
        common + ["--node-rank", "0", "--port", str(port)], stdout=logs["leader"], stderr=subprocess.STDOUT
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert leader.poll() is None and worker.poll() is None, "a node exited during start-up"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the two-node group did not become healthy"
            time.sleep(0.5)
        r = httpx.post(
            f"{base}/v1/completions", json={"prompt": "w5 w6 w7", "max_tokens": 8, "temperature": 0}, timeout=30
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        worker_ranks = [int(p) for p in subprocess.check_output(["pgrep", "-P", str(worker.pid)]).split()]

        killed = time.monotonic()
        os.kill(worker.pid, signal.SIGKILL)  # the whole worker node: its rank notices its parent is gone
        while (health := _health_status(base)) == 200:
            assert time.monotonic() - killed < 10, "the leader did not notice the dead node"
            time.sleep(0.1)
        # 503 while the leader shuts down; or it has already exited and nothing listens (None).
        assert health in (503, None), health
        assert leader.wait(30) != 0  # the group fails as a whole: Kubernetes (LWS) restarts it
        logs["leader"].seek(0)
        assert "pipeline-parallel worker rank 1" in logs["leader"].read()
        time.sleep(1.5)
        assert not any(_alive(pid) for pid in worker_ranks)
    finally:
        for proc in (leader, worker):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for f in logs.values():
            f.close()

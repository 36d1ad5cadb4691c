"""The whole P/D path as a user runs it: `kvserve router --prefill-backend P --decode-backend D` (its own
process) in front of two `kvserve serve` processes with --kv-transfer-config (kv_producer, kv_consumer). The
client's greedy answer equals the aggregated one, streamed or not, and the router took the remote-prefill path
(the engines handed the KV over); then the prefill server dies and the same request still gets the same one
answer (the router falls back to aggregated serving on the decode server)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("nixl_cu12", reason="P/D disaggregation needs NIXL: pip install 'kvserve[disagg]'")

from tests.disagg.pd_testing import free_port, transfer_config
from tests.server.serve_process import GroupServer

PROMPT = "Once upon a time there was a little girl who lived in a village near the forest. " * 3
BODY = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def _pd_requests(router_url: str, path: str) -> float:
    """kvserve_router:pd_requests_total summed over reasons for one path, from the router's /metrics."""
    total = 0.0
    for line in httpx.get(router_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvserve_router:pd_requests_total{") and f'path="{path}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def pd_stack(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("pd-router-cache"))
    procs: list = []
    router = None
    try:
        p = GroupServer(cache, "--kv-transfer-config", transfer_config("kv_producer", "prefill-0", free_port()))
        procs.append(p)
        d = GroupServer(cache, "--kv-transfer-config", transfer_config("kv_consumer", "decode-0", handshake_timeout=2))
        procs.append(d)
        port = free_port()
        cmd = [sys.executable, "-m", "kvserve.cli", "router", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--prefill-backend", p.base_url, "--decode-backend", d.base_url, "--max-local-prefill-length", "8"]
        router = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert router.poll() is None, "kvserve router exited"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the router did not become healthy"
            time.sleep(0.3)
        yield p, d, url
    finally:
        if router is not None:
            router.kill()
            router.wait(10)
        for proc in procs:
            proc.kill()


def _stream_text(url: str) -> str:
    text = []
    with httpx.stream("POST", url + "/v1/completions", json={**BODY, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += [c["text"] for c in json.loads(line[6:])["choices"]]
    return "".join(text)


def test_router_pd_equals_aggregated_then_survives_the_prefill_servers_death(pd_stack):
    p, d, url = pd_stack
    ref = httpx.post(d.base_url + "/v1/completions", json=BODY, timeout=120).json()["choices"][0]["text"]
    out = httpx.post(url + "/v1/completions", json=BODY, timeout=120)
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["text"] == ref
    assert "kv_transfer_params" not in out.json() or out.json()["kv_transfer_params"] is None
    assert _stream_text(url) == ref
    assert _pd_requests(url, "remote_prefill") == 2 and _pd_requests(url, "fallback") == 0
    p.kill()
    out = httpx.post(url + "/v1/completions", json=BODY, timeout=120)
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["text"] == ref
    assert _pd_requests(url, "fallback") + _pd_requests(url, "local") >= 1

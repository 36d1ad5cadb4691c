"""The Gateway API Inference Extension's model-server contract (issue 26 item 3) against a real `kvserve serve`
process: /metrics parsed into families with a Prometheus text parser, as the endpoint picker scrapes it
(GIE's metrics client reads family names and labels only), gives the queue and KV gauges it scores on, and
`vllm:cache_config_info` whose `block_size` / `num_gpu_blocks` labels are the engine's real KV pool (the
prefix-cache scorer hashes prompts in block_size chunks, so a wrong label silently breaks its matching)."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import STORIES_DIR
from tests.server.serve_process import GroupServer

pytestmark = pytest.mark.timeout(300)
BLOCK_SIZE = 32  # not the default 16, so the label is shown to follow the flag


def _families(base_url: str) -> dict:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _gauge(families: dict, name: str) -> float:
    (sample,) = [s for s in families[name].samples if s.name == name]
    return sample.value


def test_endpoint_picker_reads_queue_kv_and_cache_config_from_a_real_server(tmp_path):
    server = GroupServer(
        str(tmp_path),
        str(STORIES_DIR),
        "--max-model-len",
        "512",
        "--block-size",
        str(BLOCK_SIZE),
        "--max-num-seqs",
        "2",
        wait=False,
    )
    try:
        server.wait_healthy(timeout_s=240)
        families = _families(server.base_url)
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
            assert families[name].type == "gauge", name
            assert _gauge(families, name) == 0, name
        (info,) = families["vllm:cache_config_info"].samples
        assert info.value == 1 and info.labels["block_size"] == str(BLOCK_SIZE)
        # num_gpu_blocks is vLLM's count, the null block included: the ready line's total, usable + 1.
        (ready,) = [line for line in server.log if "ready: model=" in line]
        total, usable = map(int, re.search(r"kv_blocks=(\d+) \((\d+) usable", ready).groups())
        assert info.labels["num_gpu_blocks"] == str(total) and total == usable + 1
        assert _gauge(families, "kvserve:kv_capacity_tokens") == usable * BLOCK_SIZE

        # Saturated (2 seats, 8 long requests): the picker sees a queue, both seats busy and KV in use.
        body = {"prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True, "temperature": 0}
        threads = [
            threading.Thread(target=lambda: httpx.post(server.base_url + "/v1/completions", json=body, timeout=200))
            for _ in range(8)
        ]
        for t in threads:
            t.start()
        seen = set()
        deadline = time.monotonic() + 120
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            f = _families(server.base_url)
            waiting, running = _gauge(f, "vllm:num_requests_waiting"), _gauge(f, "vllm:num_requests_running")
            usage = _gauge(f, "vllm:kv_cache_usage_perc")
            assert 0 <= usage <= 1 and running <= 2
            if waiting > 0 and running == 2 and usage > 0:
                seen.add("saturated")
            time.sleep(0.05)
        for t in threads:
            t.join(200)
        assert seen == {"saturated"}
        idle = _families(server.base_url)
        assert _gauge(idle, "vllm:num_requests_waiting") == _gauge(idle, "vllm:num_requests_running") == 0
    finally:
        server.kill()

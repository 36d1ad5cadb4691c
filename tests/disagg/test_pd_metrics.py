"""The P/D connector's counters on /metrics (runtime/metrics.py): two in-process engines with real NIXL agents
(UCX, host memory); each engine's EngineStats goes through ServerMetrics as the server's stats path does."""

from __future__ import annotations

import random
import time

import pytest

pytest.importorskip("nixl_cu12", reason="P/D disaggregation needs NIXL: pip install 'kvserve[disagg]'")

from kvserve.runtime.metrics import ServerMetrics
from tests.disagg.pd_testing import drain, engine, free_port, greedy, run, transfer_config

LABELS = '{engine="0",model_name="m"}'


def _sample(metrics: ServerMetrics, name: str) -> float | None:
    for line in metrics.render().decode().splitlines():
        if line.startswith(name + LABELS + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory("llama_gqa")[0]


def test_pd_counters_reach_metrics(model_dir):
    p = engine(model_dir, transfer_config("kv_producer", "prefill-m", free_port(), abort_request_timeout=0.5))
    d = engine(model_dir, transfer_config("kv_consumer", "decode-m", handshake_timeout=1.0))
    a = engine(model_dir)
    try:
        pm, dm, am = (ServerMetrics("m", 512) for _ in range(3))
        pm.update_from_stats(p.get_stats())
        dm.update_from_stats(d.get_stats())
        am.update_from_stats(a.get_stats())
        # Connector on: the series exist at 0 before any event; an engine without one exports none.
        assert _sample(dm, "vllm:nixl_num_failed_transfers_total") == 0.0
        assert _sample(pm, "kvserve:pd_leases_held") == 0.0
        assert _sample(am, "kvserve:pd_leases_held") is None
        assert _sample(am, "vllm:nixl_num_kv_expired_reqs_total") is None

        # A remote prefill of 40 tokens: 3 blocks leased, then 39 tokens pulled and the lease released.
        prompt = _prompt(1, 40)
        first = run(p, "m-p", prompt, greedy(1, {"do_remote_decode": True}))
        pm.update_from_stats(p.get_stats())
        assert _sample(pm, "kvserve:pd_leases_held") == 1.0
        assert _sample(pm, "kvserve:pd_leased_blocks") == 3.0
        run(d, "m-d", prompt, greedy(4, first.kv_transfer_params), p)
        drain(p)
        pm.update_from_stats(p.get_stats())
        dm.update_from_stats(d.get_stats())
        assert _sample(dm, "kvserve:pd_pulled_tokens_total") == 39.0
        assert _sample(pm, "kvserve:pd_leases_held") == 0.0 and _sample(pm, "kvserve:pd_leased_blocks") == 0.0
        assert _sample(pm, "vllm:nixl_num_kv_expired_reqs_total") == 0.0

        # A lease nobody pulls expires; a pull from a dead prefill engine fails (and recomputes).
        run(p, "m-p2", _prompt(2, 20), greedy(1, {"do_remote_decode": True}))
        deadline = time.monotonic() + 10
        while p.has_unfinished_requests() and time.monotonic() < deadline:
            p.step()
        pm.update_from_stats(p.get_stats())
        assert _sample(pm, "vllm:nixl_num_kv_expired_reqs_total") == 1.0
        dead = {**first.kv_transfer_params, "remote_engine_id": "gone", "remote_port": free_port()}
        run(d, "m-dead", prompt, greedy(2, dead))
        dm.update_from_stats(d.get_stats())
        dm.update_from_stats(d.get_stats())  # a second snapshot adds nothing: counters advance by differences
        assert _sample(dm, "vllm:nixl_num_failed_transfers_total") == 1.0
        assert _sample(dm, "kvserve:pd_pulled_tokens_total") == 39.0
    finally:
        for e in (p, d, a):
            e.shutdown()

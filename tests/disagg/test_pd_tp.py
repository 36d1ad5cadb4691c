"""P/D under tensor_parallel_size=2 on both engines (CPU/gloo worker processes): every rank pulls its own KV
heads' shard from the prefill engine's rank of the same index, and the ranks agree before a pull or a lease
ends. The reference is the prefill engine itself answering the plain request (aggregated, same TP=2 shards)."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("nixl_cu12", reason="P/D disaggregation needs NIXL: pip install 'kvserve[disagg]'")

from tests.disagg.pd_testing import drain, engine, free_port, greedy, run, transfer_config  # noqa: E402


def _free_port_pair() -> int:
    """A port p with p + 1 free too (rank 1's side channel); another test's socket may hold p + 1, so draw again."""
    import socket

    for _ in range(50):
        port = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise AssertionError("no two free consecutive ports on 127.0.0.1")


@pytest.mark.timeout(600)
def test_tp2_pd_equals_aggregated(model_factory):
    model_dir = model_factory("llama_gqa")[0]  # 2 KV heads: one per rank
    port = _free_port_pair()  # rank r's side channel listens on side_channel_port + r
    p = engine(model_dir, transfer_config("kv_producer", "prefill-tp", port), tensor_parallel_size=2)
    d = None
    try:
        d = engine(model_dir, transfer_config("kv_consumer", "decode-tp"), tensor_parallel_size=2)
        rng = random.Random(5)
        for i, length in enumerate((9, 40, 97)):
            prompt = [rng.randrange(3, 500) for _ in range(length)]
            ref = run(p, f"agg-{i}", prompt, greedy(10)).outputs[0].token_ids
            first = run(p, f"p-{i}", prompt, greedy(1, {"do_remote_decode": True}))
            assert first.kv_transfer_params["tp_size"] == 2
            out = run(d, f"d-{i}", prompt, greedy(10, first.kv_transfer_params), p)
            assert out.outputs[0].token_ids == ref
            drain(p)
            assert p.scheduler.pd.num_leased_blocks == 0 and p.scheduler.pd.num_leases_expired == 0
        assert d.scheduler.pd.num_failed_pulls == 0 and d.scheduler.pd.num_pulled_tokens == 8 + 39 + 96
    finally:
        p.shutdown()
        if d is not None:
            d.shutdown()

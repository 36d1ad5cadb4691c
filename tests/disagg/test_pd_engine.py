"""P/D disaggregation through two in-process engines with real NIXL agents (UCX, host memory): a prefill engine
(kv_producer) computes a prompt and leases its blocks, a decode engine (kv_consumer) pulls them and decodes;
compared token for token with a third, aggregated engine (fp32, TP=1)."""

from __future__ import annotations

import random
import time

import pytest

pytest.importorskip("nixl_cu12", reason="P/D disaggregation needs NIXL: pip install 'kvserve[disagg]'")

from kvserve.runtime.sampling_params import SamplingParams
from tests.disagg.pd_testing import ENGINE_KWARGS, drain, engine, free_port, greedy, run, transfer_config

NUM_OUT = 12


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory("llama_gqa")[0]


@pytest.fixture(scope="module")
def engines(model_dir):
    port = free_port()
    p = engine(model_dir, transfer_config("kv_producer", "prefill-0", port))
    d = engine(model_dir, transfer_config("kv_consumer", "decode-0", handshake_timeout=1.0))
    a = engine(model_dir)
    yield p, d, a
    for e in (p, d, a):
        e.shutdown()


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


def _pd(p, d, rid: str, prompt: list[int], num_out: int = NUM_OUT):
    """The toy proxy's two legs; returns (prefill output, decode output)."""
    first = run(p, f"{rid}-p", prompt, greedy(1, {"do_remote_decode": True}))
    assert first.kv_transfer_params is not None, "the prefill leg returned no kv_transfer_params"
    return first, run(d, f"{rid}-d", prompt, greedy(num_out, first.kv_transfer_params), p)


@pytest.mark.parametrize("length", [5, 16, 17, 33, 100, 161])
def test_pd_equals_aggregated(engines, length):
    p, d, a = engines
    prompt = _prompt(length, length)
    ref = run(a, f"agg-{length}", prompt, greedy(NUM_OUT)).outputs[0].token_ids
    pulled_before = d.scheduler.pd.num_pulled_tokens
    first, out = _pd(p, d, f"pd-{length}", prompt)
    params = first.kv_transfer_params
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "prefill-0"
    assert len(params["remote_block_ids"]) == -(-length // 16)
    assert first.outputs[0].token_ids == ref[:1]
    assert out.outputs[0].token_ids == ref
    assert d.scheduler.pd.num_pulled_tokens - pulled_before == length - 1  # all but the last prompt token
    drain(p)  # the decode engine's notification ended the lease (the default lease is 480 s)
    assert p.scheduler.pd.num_leased_blocks == 0 and p.scheduler.pd.num_leases_expired == 0


def test_decode_uses_the_pulled_kv(engines):
    """Zeroing the prefill engine's KV cache before the pull changes the decode's tokens: what it decodes
    from is the pulled KV, not a local recompute."""
    p, d, a = engines
    prompt = _prompt(7, 90)
    ref = run(a, "agg-zero", prompt, greedy(NUM_OUT)).outputs[0].token_ids
    first = run(p, "zero-p", prompt, greedy(1, {"do_remote_decode": True}))
    p.executor.runner.kv.zero_()
    out = run(d, "zero-d", prompt, greedy(NUM_OUT, first.kv_transfer_params), p)
    assert out.outputs[0].token_ids != ref
    drain(p)


def test_decode_prefix_cache_is_not_pulled(engines):
    """The decode engine's own cached prefix stays local: only the blocks after it are pulled."""
    p, d, a = engines
    shared = _prompt(11, 64)
    prompt = shared + _prompt(12, 40)
    run(d, "warm", shared + _prompt(13, 5), greedy(2))  # caches the 4 shared blocks on the decode engine
    ref = run(a, "agg-prefix", prompt, greedy(NUM_OUT)).outputs[0].token_ids
    pulled_before, hits_before = d.scheduler.pd.num_pulled_tokens, d.kv_cache_manager.prefix_cache_hits
    _, out = _pd(p, d, "prefix", prompt)
    assert out.outputs[0].token_ids == ref
    assert d.kv_cache_manager.prefix_cache_hits - hits_before == 64
    assert d.scheduler.pd.num_pulled_tokens - pulled_before == len(prompt) - 1 - 64
    drain(p)
    assert p.scheduler.pd.num_leased_blocks == 0


def test_dead_prefill_recomputes_locally(engines):
    """A prefill engine that does not answer the handshake: the decode engine recomputes; same tokens."""
    _, d, a = engines
    prompt = _prompt(21, 50)
    ref = run(a, "agg-dead", prompt, greedy(NUM_OUT)).outputs[0].token_ids
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [1, 2, 3, 4],
        "remote_engine_id": "gone-0",
        "remote_request_id": "x",
        "remote_host": "127.0.0.1",
        "remote_port": free_port(),  # nothing listens there
        "tp_size": 1,
    }
    failed_before = d.scheduler.pd.num_failed_pulls
    out = run(d, "dead-d", prompt, greedy(NUM_OUT, params))
    assert out.outputs[0].token_ids == ref
    assert d.scheduler.pd.num_failed_pulls == failed_before + 1


def test_lease_expiry_frees_prefill_blocks(model_dir):
    p = engine(model_dir, transfer_config("kv_producer", "prefill-lease", free_port(), abort_request_timeout=0.3))
    try:
        free_before = p.kv_cache_manager.num_free_blocks
        first = run(p, "lease", _prompt(31, 40), greedy(1, {"do_remote_decode": True}))
        assert p.scheduler.pd.num_leased_blocks == len(first.kv_transfer_params["remote_block_ids"]) == 3
        assert p.kv_cache_manager.num_free_blocks < free_before
        assert p.has_unfinished_requests()  # the engine keeps stepping to poll for the notification
        deadline = time.monotonic() + 10
        while p.has_unfinished_requests() and time.monotonic() < deadline:
            p.step()
        assert p.scheduler.pd.num_leases_expired == 1 and p.scheduler.pd.num_leased_blocks == 0
        assert p.kv_cache_manager.num_free_blocks == free_before
    finally:
        p.shutdown()


def test_abort_during_pull_frees_blocks_after_the_transfer(engines):
    p, d, _ = engines
    prompt = _prompt(41, 70)
    free_before = d.kv_cache_manager.num_free_blocks
    first = run(p, "abort-p", prompt, greedy(1, {"do_remote_decode": True}))
    d.add_request("abort-d", prompt, greedy(NUM_OUT, first.kv_transfer_params))
    d.step()  # admitted: blocks allocated, the pull recorded
    assert "abort-d#0" in d.scheduler.receiving
    d.abort_request("abort-d")
    drain(d, p)
    assert d.kv_cache_manager.num_free_blocks == free_before
    assert p.scheduler.pd.num_leased_blocks == 0


def test_n2_decode_leg(engines):
    """n=2 on the decode leg: the first sample pulls, the second takes the prompt from the prefix cache or
    computes it; both equal the aggregated samples (greedy)."""
    p, d, a = engines
    prompt = _prompt(51, 60)
    ref = run(a, "agg-n2", prompt, SamplingParams(n=2, temperature=0, max_tokens=NUM_OUT, ignore_eos=True))
    first = run(p, "n2-p", prompt, greedy(1, {"do_remote_decode": True}))
    params = SamplingParams(
        n=2, temperature=0, max_tokens=NUM_OUT, ignore_eos=True, kv_transfer_params=first.kv_transfer_params
    )
    out = run(d, "n2-d", prompt, params, p)
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
    drain(p)
    assert p.scheduler.pd.num_leased_blocks == 0


def test_offline_generate_does_not_wait_out_the_lease(model_dir):
    """LLM.generate on a prefill engine returns when its requests are done, not when their leases end."""
    from kvserve.runtime.engine.llm import LLM

    llm = LLM(
        model_dir, kv_transfer_config=transfer_config("kv_producer", "prefill-offline", free_port()), **ENGINE_KWARGS
    )
    try:
        start = time.monotonic()
        (out,) = llm.generate([_prompt(61, 30)], greedy(1, {"do_remote_decode": True}), use_tqdm=False)
        assert out.kv_transfer_params["do_remote_prefill"] is True
        assert time.monotonic() - start < 60
    finally:
        llm.engine.shutdown()


def test_pull_after_lease_expiry_recomputes(engines, model_dir):
    """A decode leg that comes after the prefill's lease expired and its blocks were reused by another
    request: the lease check fails the pull and the decode engine recomputes (without it, it would decode
    from the other request's KV)."""
    _, d, a = engines
    p = engine(
        model_dir,
        transfer_config("kv_producer", "prefill-expiring", free_port(), abort_request_timeout=0.3),
        num_kv_blocks=8,  # 7 usable: the next request must take the expired lease's blocks
        max_model_len=112,
    )
    try:
        prompt = _prompt(71, 40)
        ref = run(a, "agg-expired", prompt, greedy(NUM_OUT)).outputs[0].token_ids
        first = run(p, "expired-p", prompt, greedy(1, {"do_remote_decode": True}))
        deadline = time.monotonic() + 10
        while p.scheduler.pd.num_leases_expired == 0 and time.monotonic() < deadline:
            p.step()
        assert p.scheduler.pd.num_leases_expired == 1
        run(p, "overwrite", _prompt(72, 110), greedy(1))  # 7 blocks: every block of the pool, rewritten
        failed_before = d.scheduler.pd.num_failed_pulls
        out = run(d, "expired-d", prompt, greedy(NUM_OUT, first.kv_transfer_params), p)
        assert out.outputs[0].token_ids == ref
        assert d.scheduler.pd.num_failed_pulls == failed_before + 1
    finally:
        p.shutdown()

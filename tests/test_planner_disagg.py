"""Issue 42 scope 5: the planner compares aggregated and disaggregated fleets with the same simulator."""

import math

import pytest

from kvserve.runtime.planner import disagg
from kvserve.runtime.planner.fleet import Candidate, evaluate
from kvserve.runtime.planner.simulator import EngineShape, LengthSpec, Workload, simulate
from kvserve.runtime.planner.slo import SLO
from kvserve.runtime.planner.step_time import StepTimeModel

# 8 ms a step plus 0.1 ms a token: a 2,048-token prefill chunk is a 0.21 s step, a decode of 40 sequences 12 ms.
MODEL = StepTimeModel(overhead_s=0.008, per_token_s=1e-4, per_context_token_s=0.0)
KV_BYTES_PER_TOKEN = 131_072  # Llama-3-8B's (bf16, 8 KV heads x 128 x 32 layers x K and V)


def candidate(max_num_batched_tokens: int = 2048) -> Candidate:
    shape = EngineShape(
        num_blocks=40_000, max_num_seqs=128, max_num_batched_tokens=max_num_batched_tokens, max_model_len=4096
    )
    return Candidate("h100-80gb", 1, 2.0, shape, MODEL, "test model", kv_bytes_per_token=KV_BYTES_PER_TOKEN)


def test_a_decode_replica_computes_only_the_last_prompt_token_and_the_decodes():
    w = Workload(prompt_len=LengthSpec(1000, 1000), output_len=LengthSpec(5, 5), num_requests=1, concurrency=1)
    both = simulate(w, EngineShape(num_blocks=128, max_num_batched_tokens=256), MODEL)
    decode = simulate(w, EngineShape(num_blocks=128, max_num_batched_tokens=256, role="decode"), MODEL)
    assert both.num_steps == 4 + 4  # ceil(1000/256) prefill chunks, then 4 decodes
    assert decode.num_steps == 1 + 4  # the pulled prompt fits one step (no budget), then 4 decodes
    assert decode.ttft_s["p50"] == pytest.approx(MODEL.step_seconds(1, 1000))  # only the last prompt token's row
    assert decode.tpot_s["p50"] == pytest.approx(sum(MODEL.step_seconds(1, 1000 + k) for k in range(1, 5)) / 4)


def test_a_prefill_replica_runs_prompts_and_first_tokens_only():
    w = Workload(prompt_len=LengthSpec(300, 300), output_len=LengthSpec(50, 50), num_requests=10, concurrency=2)
    r = simulate(w, EngineShape(num_blocks=512, role="prefill"), MODEL)
    assert r.num_steps == 5  # two prompts a step, one token each, done
    assert r.tpot_s["p99"] == 0.0 and r.output_tokens_per_s * r.duration_s == pytest.approx(10)
    with pytest.raises(ValueError, match="role"):
        EngineShape(num_blocks=8, role="producer")


def test_transfer_time_is_the_prompts_kv_over_the_link():
    assert disagg.transfer_seconds(2048, KV_BYTES_PER_TOKEN, 25.0) == pytest.approx(2048 * 131_072 / 25e9)
    with pytest.raises(ValueError, match="kv_transfer_gb_s"):
        disagg.transfer_seconds(1, 1, 0.0)


def _both(prompt: int, output: int, slo: SLO, rate: float):
    w = Workload(LengthSpec(prompt, prompt), LengthSpec(output, output), num_requests=120, request_rate=rate, seed=3)
    c = candidate()
    agg = evaluate(c, w, slo, rate)
    dis = disagg.evaluate_disaggregated(c, w, slo, rate)
    return agg, dis


def test_disaggregation_wins_with_long_prompts_and_a_tight_tpot():
    # Every 0.21 s prefill step lands in the decodes of everyone running beside it: aggregated, TPOT p99 <= 25 ms
    # holds only at low load per replica; the decode pool never sees a prefill chunk.
    agg, dis = _both(2048, 128, SLO(ttft_p90_s=2.0, tpot_p99_s=0.025), rate=20.0)
    assert agg.hpa is not None and dis.feasible
    assert dis.usd_per_hour < agg.usd_per_hour  # 5 prefill + 1 decode against 9 aggregated replicas here
    assert dis.tpot_p99_s <= 0.025 and dis.ttft_p90_s <= 2.0
    assert (
        dis.prefill_replicas >= 1
        and dis.decode_replicas >= 1
        and dis.ratio == (f"{dis.prefill_replicas}:{dis.decode_replicas}")
    )
    assert disagg.decide("auto", agg.usd_per_hour, dis.usd_per_hour) == "disaggregated"
    assert disagg.decide("off", agg.usd_per_hour, dis.usd_per_hour) == "aggregated"


def test_disaggregation_loses_with_short_prompts():
    # 64-token prompts barely slow a decode step (a decode pool serves 35 req/s, an aggregated replica 31): one
    # aggregated replica serves 30 req/s, the split fleet needs a replica in each pool.
    agg, dis = _both(64, 128, SLO(ttft_p90_s=1.0, tpot_p99_s=0.05), rate=30.0)
    assert agg.hpa is not None and dis.feasible
    assert dis.usd_per_hour > agg.usd_per_hour
    assert disagg.decide("auto", agg.usd_per_hour, dis.usd_per_hour) == "aggregated"
    assert disagg.decide("on", agg.usd_per_hour, dis.usd_per_hour) == "disaggregated"


def test_a_slow_link_makes_disaggregation_infeasible():
    w = Workload(LengthSpec(2048, 2048), LengthSpec(16, 16), num_requests=40, request_rate=2.0)
    dis = disagg.evaluate_disaggregated(candidate(), w, SLO(0.5, 0.05), 2.0, link_gb_s=0.5)  # 0.54 s transfer
    assert not dis.feasible and "KV transfer" in dis.reason and math.isinf(dis.usd_per_hour)
    with pytest.raises(ValueError, match="disaggregation"):
        disagg.decide("sometimes", 1.0, 2.0)

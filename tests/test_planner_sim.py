"""Planner simulator (runtime/planner): the real scheduler on a simulated clock, and the step-time fit."""

import random

import pytest

from kvserve.runtime.planner.simulator import EngineShape, LengthSpec, Workload, load_trace, percentile, simulate
from kvserve.runtime.planner.step_time import StepSample, StepTimeModel, _least_squares, fit

MODEL = StepTimeModel(overhead_s=0.01, per_token_s=1e-4, per_context_token_s=1e-6)


def test_fit_recovers_known_coefficients():
    rng = random.Random(0)
    truth = StepTimeModel(0.003, 2e-5, 4e-8)
    samples = []
    for _ in range(60):
        n, c = rng.randint(1, 2048), rng.randint(1, 200_000)
        samples.append(StepSample(n, c, truth.step_seconds(n, c) * (1 + rng.uniform(-0.01, 0.01))))
    model, stats = fit(samples)
    assert model.overhead_s == pytest.approx(truth.overhead_s, rel=0.1)
    assert model.per_token_s == pytest.approx(truth.per_token_s, rel=0.05)
    assert model.per_context_token_s == pytest.approx(truth.per_context_token_s, rel=0.1)
    assert stats["max_abs_rel_error"] < 0.05
    with pytest.raises(ValueError, match="at least 3"):
        fit(samples[:2])


def test_single_request_matches_hand_computed_timeline():
    # One 100-token prompt in one prefill step, then 9 decode steps: every time is the model's sum.
    w = Workload(prompt_len=LengthSpec(100, 100), output_len=LengthSpec(10, 10), num_requests=1, concurrency=1)
    r = simulate(w, EngineShape(num_blocks=64), MODEL)
    prefill = MODEL.step_seconds(100, 100)
    decodes = [MODEL.step_seconds(1, 100 + k) for k in range(1, 10)]
    assert r.num_steps == 10
    assert r.ttft_s["p50"] == pytest.approx(prefill)
    assert r.tpot_s["p50"] == pytest.approx(sum(decodes) / 9)
    assert r.duration_s == pytest.approx(prefill + sum(decodes))


def test_chunked_prefill_splits_long_prompt():
    w = Workload(prompt_len=LengthSpec(1000, 1000), output_len=LengthSpec(2, 2), num_requests=1, concurrency=1)
    r = simulate(w, EngineShape(num_blocks=128, max_num_batched_tokens=256), MODEL)
    assert r.num_steps == 4 + 1  # ceil(1000/256) prefill chunks, one decode


def test_small_pool_preempts_and_still_finishes():
    w = Workload(prompt_len=LengthSpec(200, 200), output_len=LengthSpec(200, 200), num_requests=40, concurrency=16)
    r = simulate(w, EngineShape(num_blocks=120), MODEL)
    assert r.num_requests == 40 and r.num_preemptions > 0 and r.kv_peak_usage == pytest.approx(1.0, abs=0.05)


def test_prefix_sharing_cuts_ttft():
    base = dict(prompt_len=LengthSpec(1024, 1024), output_len=LengthSpec(4, 4), num_requests=50, concurrency=1)
    cold = simulate(Workload(**base), EngineShape(num_blocks=512), MODEL)
    warm = simulate(Workload(**base, prefix_len=960), EngineShape(num_blocks=512), MODEL)
    assert warm.ttft_s["p50"] < cold.ttft_s["p50"] / 3


def test_poisson_load_raises_latency_and_is_deterministic():
    def run(rate):
        w = Workload(
            prompt_len=LengthSpec.parse("64:512", "p"),
            output_len=LengthSpec(32, 32),
            num_requests=300,
            request_rate=rate,
            seed=3,
        )
        return simulate(w, EngineShape(num_blocks=4000), MODEL)

    light, heavy = run(0.5), run(20.0)
    assert heavy.ttft_s["p90"] > light.ttft_s["p90"]
    assert light.requests_per_s == pytest.approx(0.5, rel=0.3)  # it keeps up with the offered load
    assert run(0.5).to_dict() == light.to_dict()


def test_trace_and_bad_input(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(
        '{"arrival_s": 0.0, "prompt_len": 10, "output_len": 3}\n{"arrival_s": 5.0, "prompt_len": 10, "output_len": 3}\n'
    )
    r = simulate(Workload(trace=load_trace(str(p))), EngineShape(num_blocks=16), MODEL)
    assert r.num_requests == 2 and r.duration_s > 5.0
    p.write_text("{bad\n")
    with pytest.raises(ValueError, match="t.jsonl:1"):
        load_trace(str(p))
    with pytest.raises(ValueError, match="prompt_len"):
        LengthSpec.parse("9:3", "prompt_len")
    with pytest.raises(ValueError, match="exactly one"):
        Workload(request_rate=1.0, concurrency=2)
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([], 99) == 0.0


def test_fit_ignores_descheduled_steps():
    # 10% of the steps took 3-6x longer (the OS ran someone else): the fit is the other 90%'s.
    rng = random.Random(1)
    truth = StepTimeModel(0.02, 5e-5, 1e-7)
    samples = []
    for i in range(100):
        n, c = rng.randint(1, 2048), rng.randint(1, 50_000)
        slow = rng.uniform(3, 6) if i % 10 == 0 else 1.0
        samples.append(StepSample(n, c, truth.step_seconds(n, c) * slow * (1 + rng.uniform(-0.02, 0.02))))
    model, stats = fit(samples)
    assert stats["num_outliers_dropped"] >= 10
    assert model.overhead_s == pytest.approx(truth.overhead_s, rel=0.15)
    assert model.per_token_s == pytest.approx(truth.per_token_s, rel=0.1)
    plain = _least_squares(samples)  # the same data without dropping the slow steps
    assert abs(plain.per_token_s - truth.per_token_s) > abs(model.per_token_s - truth.per_token_s)

"""runtime/bench/planner_accuracy.py on a tiny random model: the measured side counts what the simulator counts
(every output token, every request's TTFT and TPOT), and the simulator is given the same request sequence
(closed loop, or the measured Poisson arrival times as a trace). No timing bound here: the timed check on
this shared 2-core machine is test_planner_calibrate.py's loose best-of-three."""

from __future__ import annotations

import random

import pytest

from kvserve.runtime.bench import planner_accuracy as pa
from kvserve.runtime.bench.calibrate import Grid

CASES = (
    pa.Case("closed-4", 40, 3, 10, concurrency=4, ramp_s=0.2, output_len_max=8),
    pa.Case("poisson", 40, 6, 10, load=0.5),
    pa.Case("prefix", 72, 4, 6, concurrency=3, prefix_len=64),
)


@pytest.fixture(scope="module")
def result(model_factory):
    tiny = model_factory("llama_gqa")[0]
    grid = Grid(prompt_lens=(16, 64), batch_sizes=(1, 4), decode_steps=4, warmup_steps=2)
    return pa.run(tiny, 0, None, CASES, grid, clock="cpu")


def test_every_workload_has_both_sides_and_its_error(result):
    assert [r["workload"] for r in result["rows"]] == [c.name for c in CASES]
    for row in result["rows"]:
        for side in ("predicted", "measured"):
            assert set(pa.BOUNDS) <= set(row[side]) and all(row[side][k] > 0 for k in pa.BOUNDS)
        for key in pa.BOUNDS:
            p, m = row["predicted"][key], row["measured"][key]
            assert row["error"][key] == pytest.approx((p - m) / m)
        assert row["within_bounds"] == all(abs(row["error"][k]) <= b for k, b in pa.BOUNDS.items())
    poisson = result["rows"][1]
    assert poisson["request_rate"] > 0 and result["rows"][0]["request_rate"] is None


def test_the_simulator_sees_the_measured_request_sequence():
    case = CASES[1]
    requests = pa._requests(case, random.Random(0), 512, rate=4.0)
    arrivals = [a for a, _, _ in requests]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    # The same arrivals as a trace: the prediction of a sparse load is one request's latency, not a queue.
    step = pa.StepTimeModel(0.01, 1e-4, 0.0)
    p = pa.predict(case, requests, step)
    assert p["ttft_p50_s"] == pytest.approx(step.step_seconds(40, 40))
    assert p["tpot_p50_s"] == pytest.approx(step.step_seconds(1, 41), rel=0.02)
    shared = pa._requests(CASES[2], random.Random(0), 512, rate=None)
    assert {tuple(p[:64]) for _, p, _ in shared} == {tuple(shared[0][1][:64])}
    assert len({tuple(p) for _, p, _ in shared}) == len(shared)


def test_a_closed_loop_is_replayed_with_its_ramp_and_lengths():
    case = CASES[0]
    requests = pa._requests(case, random.Random(0), 512, rate=None)
    lengths = [o for _, _, o in requests]
    assert all(3 <= o <= 8 for o in lengths) and len(set(lengths)) > 1
    assert pa.stream_starts(case) == pytest.approx([0.0, 0.05, 0.1, 0.15])
    # The simulator gets the streams' starts and every request's drawn length: with 1-2 ms steps the first stream
    # runs alone for 50 ms (a 40-token prefill, then its decodes), and every drawn output token is produced.
    step = pa.StepTimeModel(0.001, 1e-6, 0.0)
    trace = pa.replay_trace(case, requests)
    assert [a for a, _, _ in trace[:4]] == pa.stream_starts(case)
    r = pa.simulate(pa.Workload(trace=trace, concurrency=case.concurrency), pa.SHAPE, step, record_steps=True)
    assert r.step_tokens[: lengths[0]] == [40] + [1] * (lengths[0] - 1)
    assert r.output_tokens_per_s * r.duration_s == pytest.approx(sum(lengths)) and r.duration_s > 0.15
    assert pa.predict(case, requests, step)["num_steps"] == r.num_steps  # predict builds the same trace


def test_cpu_clock_skips_idle_time_and_wall_clock_sleeps():
    cpu = pa.Clock("cpu")
    before = cpu.now()
    cpu.wait_until(before + 5.0)  # no work to do until an arrival 5 s on: skipped, not slept
    assert 5.0 <= cpu.now() - before < 5.5
    wall = pa.Clock("wall")
    wall.wait_until(0.05)
    assert wall.now() >= 0.05
    with pytest.raises(ValueError, match="--clock"):
        pa.Clock("gpu")


def test_error_is_relative_to_the_measurement():
    assert pa.error(115.0, 100.0) == pytest.approx(0.15) and pa.error(80.0, 100.0) == pytest.approx(-0.2)


def test_served_mode_measures_through_kvserve_serve(model_factory):
    # planner_accuracy_served: the calibration on an in-process engine, then the same workloads through
    # `kvserve serve` and the streaming client; every request is counted (a failed one raises), with the
    # simulator's metrics.
    from kvserve.runtime.bench import planner_accuracy_served as served

    tiny = model_factory("llama_gqa")[0]
    grid = Grid(prompt_lens=(16, 64), batch_sizes=(1, 4), decode_steps=4, warmup_steps=2)
    result = served.run_served(tiny, 0, CASES[:2], grid)
    assert result["mode"] == "served" and result["calibration"]["fit"]["num_samples"] >= 3
    assert [r["workload"] for r in result["rows"]] == ["closed-4", "poisson"]
    for row in result["rows"]:
        assert set(row["measured"]) == set(pa.BOUNDS) and all(v > 0 for v in row["measured"].values())
        assert row["within_bounds"] == all(abs(row["error"][k]) <= b for k, b in pa.BOUNDS.items())
    assert "--kv-cache-bytes" in served.serve_args(1 << 20)


def test_fit_admission_recovers_the_front_end_time_from_burst_schedules():
    # Bursts "logged" from the simulator itself with a 1 ms front-end: the fit finds 1 ms, and 0 for bursts
    # that reached the core at once.
    import dataclasses

    from kvserve.runtime.bench import planner_accuracy_served as served
    from kvserve.runtime.planner.simulator import LengthSpec, Workload, simulate

    step = pa.StepTimeModel(0.03, 1.5e-3, 0.0)

    def logged(admission_s: float) -> list:
        out = []
        for prompt_len, batch in ((16, 32), (16, 128), (256, 16)):
            w = Workload(LengthSpec(prompt_len, prompt_len), LengthSpec(4, 4), batch, concurrency=batch)
            shape = dataclasses.replace(pa.SHAPE, admission_s=admission_s)
            out.append((prompt_len, batch, simulate(w, shape, step, record_steps=True).step_tokens))
        return out

    assert logged(1e-3)[1][2][0] == 16  # the first step: the first request alone
    assert served.fit_admission(logged(1e-3), 4, step) == (1e-3, 0.0)
    assert served.fit_admission(logged(0.0), 4, step)[0] == 0.0

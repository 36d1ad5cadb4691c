"""Planner simulator (runtime/planner): the real scheduler on a simulated clock, and the step-time fit."""

import random

import pytest

from kvserve.runtime.planner.simulator import EngineShape, LengthSpec, Workload, load_trace, percentile, simulate
from kvserve.runtime.planner.step_time import (
    StepSample,
    StepTimeModel,
    StepWork,
    _least_squares,
    curve_knots,
    fit,
    step_work,
)

MODEL = StepTimeModel(overhead_s=0.01, per_token_s=1e-4, per_context_token_s=1e-6)


def test_fit_recovers_known_coefficients():
    rng = random.Random(0)
    truth = StepTimeModel(0.003, 2e-5, 4e-8)
    samples = []
    for _ in range(60):
        n, c = rng.randint(1, 2048), rng.randint(1, 200_000)
        samples.append(StepSample(n, c, truth.step_seconds(n, c) * (1 + rng.uniform(-0.01, 0.01))))
    model, stats = fit(samples, token_curve=False)
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


def test_closed_loop_replays_a_traces_lengths_in_order():
    # One stream over the trace's lengths: request k's prompt and output are the trace's k-th (the later arrivals
    # are unused), so the steps are exactly: 10-token prefill + 2 decodes, then 50 + 0, then 20 + 4.
    trace = ((0.0, 10, 3), (99.0, 50, 1), (7.0, 20, 5))
    r = simulate(Workload(trace=trace, concurrency=1), EngineShape(num_blocks=64), MODEL, record_steps=True)
    assert r.num_requests == 3
    assert r.step_tokens == [10, 1, 1, 50, 20, 1, 1, 1, 1]
    assert r.duration_s < 1.0  # no wait for the later arrivals
    # Two streams: the first `concurrency` arrivals are their start times (a ramp). The second starts at 5 s,
    # long after the first finished its two requests (each 10 + 1 + 1 tokens, ~0.04 s a step).
    trace = ((0.0, 10, 3), (5.0, 10, 3), (0.0, 10, 3))
    r = simulate(Workload(trace=trace, concurrency=2), EngineShape(num_blocks=64), MODEL, record_steps=True)
    assert r.step_tokens == [10, 1, 1, 10, 1, 1, 10, 1, 1]
    assert 5.0 < r.duration_s < 5.2 and r.ttft_s["p50"] < 0.05


def test_fit_ignores_descheduled_steps():
    # 10% of the steps took 3-6x longer (the OS ran someone else): the fit is the other 90%'s.
    rng = random.Random(1)
    truth = StepTimeModel(0.02, 5e-5, 1e-7)
    samples = []
    for i in range(100):
        n, c = rng.randint(1, 2048), rng.randint(1, 50_000)
        slow = rng.uniform(3, 6) if i % 10 == 0 else 1.0
        samples.append(StepSample(n, c, truth.step_seconds(n, c) * slow * (1 + rng.uniform(-0.02, 0.02))))
    model, stats = fit(samples, token_curve=False)
    assert stats["num_outliers_dropped"] >= 10
    assert model.overhead_s == pytest.approx(truth.overhead_s, rel=0.15)
    assert model.per_token_s == pytest.approx(truth.per_token_s, rel=0.1)
    plain = _least_squares(samples)  # the same data without dropping the slow steps
    assert abs(plain.per_token_s - truth.per_token_s) > abs(model.per_token_s - truth.per_token_s)


def _roofline_truth(w: StepWork) -> float:
    """A CPU-like step: reading the weights (40 ms) until the GEMMs' FLOPs take longer (1.6 ms a token), the LM
    head per sampled row, decode KV reads per context token, prefill query-key products per pair."""
    return max(0.040, 0.0016 * w.num_tokens) + 4e-4 * w.num_sampled + 3e-6 * w.context_tokens + 7e-7 * w.attention_pairs


def _grid_samples(rng, noise: float = 0.02) -> list[StepSample]:
    samples = []
    for batch in (1, 2, 4, 8, 16, 32, 64, 128):  # decodes at short and long contexts
        for ctx in (20, 500, 1000):
            w = StepWork(batch, batch * ctx, batch, batch * ctx)
            samples.append(StepSample.of(w, _roofline_truth(w) * (1 + rng.uniform(-noise, noise))))
    for n in (16, 64, 256, 512, 1000, 2048):  # whole prefills of one request, and four at once
        for reqs in (1, 4):
            t = n * reqs
            w = StepWork(t, t, reqs, reqs * n * (n + 1) // 2)
            samples.append(StepSample.of(w, _roofline_truth(w) * (1 + rng.uniform(-noise, noise))))
    return samples


def test_curve_fit_follows_memory_bound_then_compute_bound_steps():
    # A line through flat decodes (batch 1-16 all ~40 ms) and compute-bound prefills misses both; the curve with
    # the sampled-row and the two attention terms predicts each kind of step, and keeps prefill tokens cheaper
    # than decode tokens (no LM head) and a decode's context apart from a prefill's query-key pairs.
    rng = random.Random(2)
    model, stats = fit(_grid_samples(rng))
    assert stats["model"] == "token_curve" and stats["mean_abs_rel_error"] < 0.03
    linear, _ = fit(_grid_samples(rng), token_curve=False)
    for w in (StepWork(8, 8 * 700, 8, 8 * 700), StepWork(96, 96 * 30, 96, 96 * 30), StepWork(700, 700, 1, 245350)):
        assert model.step_seconds(*w) == pytest.approx(_roofline_truth(w), rel=0.06)
    assert abs(linear.step_seconds(4, 80) - _roofline_truth(StepWork(4, 80, 4, 80))) > 0.2 * _roofline_truth(
        StepWork(4, 80, 4, 80)
    )
    assert model.per_sampled_s == pytest.approx(4e-4, rel=0.25)
    assert model.per_context_token_s == pytest.approx(3e-6, rel=0.25)
    assert model.per_attention_pair_s == pytest.approx(7e-7, rel=0.25)
    # Round trip through the calibration JSON, and a version-1 file (three coefficients) still loads.
    assert StepTimeModel.from_dict(model.to_dict()) == model
    v1 = StepTimeModel.from_dict({"overhead_s": 0.01, "per_token_s": 1e-4, "per_context_token_s": 1e-6})
    assert v1.step_seconds(10, 100, 5, 1000) == pytest.approx(0.01 + 1e-3 + 1e-4)


def test_curve_interpolates_and_continues_end_slopes():
    m = StepTimeModel(0.0, 0.0, 0.0, token_curve=((1, 0.04), (16, 0.04), (64, 0.1)))
    assert m.token_seconds(8) == pytest.approx(0.04)
    assert m.token_seconds(40) == pytest.approx(0.07)
    assert m.token_seconds(128) == pytest.approx(0.18)  # past the last knot: its segment's slope
    with pytest.raises(ValueError, match="ascending"):
        StepTimeModel(0.0, 0.0, 0.0, token_curve=((4, 0.1), (2, 0.2)))
    assert curve_knots([1, 2, 3, 4, 8, 9, 30, 31]) == [1, 2, 3, 8, 31]


def test_step_work_counts_sampled_rows_and_attention_pairs():
    class S:
        def __init__(self, n, start, sample):
            self.token_ids, self.start_position, self.sample = [0] * n, start, sample

    # A decode at context 99, and a 10-token chunk after 20 cached tokens that does not sample yet.
    w = step_work([S(1, 99, True), S(10, 20, False)])
    assert w == StepWork(num_tokens=11, context_tokens=100 + 30, num_sampled=1, attention_pairs=100 + 10 * 20 + 55)


def test_active_set_drops_a_negative_term():
    # Steps that do not depend on the context at all, with noise: the context coefficient must not go negative
    # (more context would make a step faster).
    rng = random.Random(4)
    samples = []
    for t in (1, 4, 16, 64, 256):
        for ctx in (10, 1000, 5000):
            w = StepWork(t, t * ctx, t, t * ctx)
            samples.append(StepSample.of(w, (0.02 + 1e-3 * t) * (1 + rng.uniform(-0.03, 0.03))))
    model, _ = fit(samples)
    assert model.per_context_token_s >= 0 and model.per_attention_pair_s >= 0 and model.per_sampled_s >= 0


def test_front_end_admission_spreads_a_burst_over_the_first_steps():
    # Two requests sent at once through a front-end that takes 5 ms each: the engine starts on the first alone
    # (its prefill is one step), the second waits for that step; TTFT counts from the client's send.
    w = Workload(prompt_len=LengthSpec(100, 100), output_len=LengthSpec(2, 2), num_requests=2, concurrency=2)
    at_once = simulate(w, EngineShape(num_blocks=64), MODEL)
    served = simulate(w, EngineShape(num_blocks=64, admission_s=0.005), MODEL)
    assert at_once.num_steps == 2  # one prefill of both, one decode of both
    assert served.num_steps == 3  # prefill 1; prefill 2 + decode 1; decode 2
    first = 0.005 + MODEL.step_seconds(100, 100)
    assert served.ttft_s["p50"] == pytest.approx((first + first + MODEL.step_seconds(101, 201)) / 2)
    # FIFO: with the front-end slower than the arrivals, each request waits for the one before it.
    p = Workload(prompt_len=LengthSpec(8, 8), output_len=LengthSpec(1, 1), num_requests=20, request_rate=1000.0)
    slow = simulate(p, EngineShape(num_blocks=64, admission_s=0.05), MODEL)
    assert slow.duration_s >= 20 * 0.05


@pytest.mark.parametrize("prefix_len", [0, 48])
@pytest.mark.parametrize("concurrency", [1, 8])
def test_request_time_floor_is_below_every_simulation(prefix_len, concurrency):
    """bounds.min_request_seconds: no simulated run (one stream, or a batch sharing its steps) spends less engine
    time per request, for a curve model with every extra term, chunked prompts and a shared prefix; and it is
    charges at least every request's sampled rows (5 at the least) and prompt tokens at the cheapest token price."""
    from kvserve.runtime.planner.bounds import cheapest_token_seconds, min_request_seconds

    curve = StepTimeModel(0.0, 0.0, 2e-7, 3e-4, 1e-9, token_curve=((1, 0.008), (16, 0.010), (256, 0.030)))
    shape = EngineShape(num_blocks=512, max_num_batched_tokens=64, max_num_seqs=8)  # 100-token prompts: 2 chunks
    w = Workload(
        LengthSpec(100, 140), LengthSpec(5, 12), num_requests=24, concurrency=concurrency, prefix_len=prefix_len
    )
    floor = min_request_seconds(curve, w, shape.max_num_batched_tokens, shape.max_model_len)
    r = simulate(w, shape, curve)
    assert 0 < floor <= r.duration_s / r.num_requests
    assert floor >= 5 * curve.per_sampled_s + (100 - prefix_len) * cheapest_token_seconds(curve, 64)
    # the GEMM curve's cheapest token is at the budget's end here (64 tokens between the knots 16 and 256)
    assert cheapest_token_seconds(curve, 64) == pytest.approx(curve.token_seconds(64) / 64)


@pytest.mark.parametrize(
    "workload, shape",
    [
        # Poisson, a pool far larger than 8 sequences fill (trimmed), no shared prefix (run without the cache)
        (Workload(LengthSpec(300, 700), LengthSpec(5, 40), num_requests=60, request_rate=40.0), EngineShape(4096)),
        # Poisson that preempts: the run starts again with the prefix cache (a recompute hits its own blocks)
        (Workload(LengthSpec(200, 200), LengthSpec(200, 200), num_requests=40, request_rate=50.0), EngineShape(120)),
        # a closed loop that overfills the pool: run with the cache from the start
        (Workload(LengthSpec(200, 200), LengthSpec(200, 200), num_requests=40, concurrency=16), EngineShape(120)),
        # a shared prefix: no shortcut
        (
            Workload(LengthSpec(256, 256), LengthSpec(8, 8), num_requests=30, concurrency=4, prefix_len=64),
            EngineShape(512),
        ),
        # prefix caching off, chunked prompts, a trace
        (
            Workload(trace=((0.0, 90, 3), (0.01, 500, 9), (0.02, 33, 20), (0.5, 700, 2))),
            EngineShape(4096, max_num_batched_tokens=128, enable_prefix_caching=False),
        ),
    ],
)
def test_shortcuts_leave_the_run_unchanged(workload, shape, monkeypatch):
    """simulate's shortcuts (no prefix cache without a shared prefix, a pool that starts small and grows) give
    the result of the plain run: the replica's whole pool from the start, the configured prefix cache."""
    from kvserve.runtime.planner import simulator

    plain = simulator._simulate(workload, shape, MODEL, True, None, shape.enable_prefix_caching)
    assert simulate(workload, shape, MODEL, record_steps=True).to_dict() == plain.to_dict()
    # Growing from 8 blocks (several doublings within the run) changes nothing either.
    monkeypatch.setattr(simulator, "INITIAL_POOL_BLOCKS", 8)
    assert simulate(workload, shape, MODEL, record_steps=True).to_dict() == plain.to_dict()
    if workload.request_rate == 40.0:
        assert plain.num_preemptions == 0 and plain.kv_peak_usage * (shape.num_blocks - 1) > 8
    if shape.num_blocks == 120:
        assert plain.num_preemptions > 0
        assert simulator._simulate(workload, shape, MODEL, True, None, False).to_dict() != plain.to_dict()


def test_the_front_end_admits_in_the_order_requests_were_sent():
    """A closed loop whose second stream starts late (a ramp): the first stream's follow-up requests, sent long
    before that start, are admitted when sent. (Booking the front-end at creation queued them behind the late
    stream's start: TTFT p90 4x the measured on the accuracy grid's ramps.)"""
    from kvserve.runtime.planner.simulator import EngineShape, LengthSpec, Workload, simulate
    from kvserve.runtime.planner.step_time import StepTimeModel

    step = StepTimeModel(0.005, 1e-5, 0.0)  # ~5 ms steps
    trace = ((0.0, 16, 4), (1.0, 16, 4)) + ((0.0, 16, 4),) * 4  # stream 2 starts at 1 s
    w = Workload(LengthSpec(16, 16), LengthSpec(4, 4), num_requests=6, concurrency=2, trace=trace)
    r = simulate(w, EngineShape(num_blocks=64, admission_s=0.001), step)
    # Every request but the late stream's first waits for at most its admission and a step or two.
    assert max(r.ttfts_s) < 0.05 and r.ttft_s["p90"] < 0.05
    assert r.duration_s > 1.0  # the late stream did start at 1 s


@pytest.mark.parametrize(
    "workload",
    [
        Workload(LengthSpec(300, 700), LengthSpec(5, 40), num_requests=60, request_rate=40.0),
        Workload(LengthSpec(200, 200), LengthSpec(30, 30), num_requests=40, concurrency=1),
        Workload(LengthSpec(200, 200), LengthSpec(30, 30), num_requests=40, concurrency=64),  # streams: 40
    ],
)
def test_runs_reuse_only_what_the_limits_did_not_decide(workload):
    """reuse.Runs answers a run for another max_num_seqs / pool size only where that run, simulated afresh,
    is the same; where the first run's sequence limit or pool bound something, it simulates again."""
    from kvserve.runtime.planner.reuse import Runs

    runs = Runs()
    first = simulate(workload, EngineShape(4096, max_num_seqs=256), MODEL, runs=runs)
    assert (runs.simulated, runs.reused) == (1, 0)
    peak = round(first.kv_peak_usage * 4095)
    # Limits above what the run reached: the same run, its peak usage against the other pool.
    for seqs, blocks in ((128, 3000), (512, 8192), (64, peak + 1)):
        shape = EngineShape(blocks, max_num_seqs=seqs)
        reused = simulate(workload, shape, MODEL, runs=runs)
        assert reused.to_dict() == simulate(workload, shape, MODEL).to_dict()
    assert (runs.simulated, runs.reused) == (1, 3)
    # A pool the run's peak does not fit, or a sequence limit it reaches: simulated, not reused.
    alone = workload.concurrency == 1
    if not alone:  # (one request at a time: a pool below its peak cannot hold the request)
        simulate(workload, EngineShape(peak, max_num_seqs=256), MODEL, runs=runs)
    running = 1 if alone else 8
    simulate(workload, EngineShape(4096, max_num_seqs=running), MODEL, runs=runs)
    assert (runs.simulated, runs.reused) == (2 if alone else 3, 3)
    # A run its sequence limit bound answers no other limit.
    bound = Runs()
    simulate(workload, EngineShape(4096, max_num_seqs=running), MODEL, runs=bound)
    simulate(workload, EngineShape(4096, max_num_seqs=running + 1), MODEL, runs=bound)
    assert (bound.simulated, bound.reused) == (2, 0)
    # Token budgets: a run whose steps all stayed under its budget is the same under any budget above its
    # largest step (one request at a time: a 200-token prompt per step); a budget that cut a step is not.
    budgets = Runs()
    largest = max(simulate(workload, EngineShape(4096), MODEL, record_steps=True, runs=budgets).step_tokens)
    for budget in (largest + 1, 4 * largest, largest, largest // 2):
        shape = EngineShape(4096, max_num_batched_tokens=budget)
        reused = simulate(workload, shape, MODEL, record_steps=True, runs=budgets)
        assert reused.to_dict() == simulate(workload, shape, MODEL, record_steps=True).to_dict()
    first_budget = EngineShape(4096).max_num_batched_tokens
    assert budgets.reused == (2 if largest < first_budget else 0) + (largest == first_budget)

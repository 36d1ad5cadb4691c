"""`kvserve calibrate` on a tiny random model: the file loads as a calibration, and the simulator with that
calibration predicts the real engine's offline throughput on a closed-loop workload within 2x."""

from __future__ import annotations

import random
import time

import pytest

from kvserve.cli.main import build_parser
from kvserve.runtime.bench.calibrate import Grid, calibrate, write
from kvserve.runtime.planner.predict import load_calibration
from kvserve.runtime.planner.simulator import EngineShape, LengthSpec, Workload, simulate
from kvserve.runtime.planner.step_time import StepTimeModel

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=256, block_size=16, num_kv_blocks=64)


@pytest.fixture(scope="module")
def tiny(model_factory):
    return model_factory("llama_gqa")[0]


# Both sides of the comparison run on one torch thread and read the process's CPU time: the suite runs two xdist
# workers on 2 cores, and with two threads each an OpenMP barrier waits (spinning) for a descheduled peer, so
# wall time, and even CPU time, measured the other worker's test (seen: 2.2x and 2.5x off in full-suite runs
# while the test passed alone). One thread's CPU time is what the step itself costs.
CLOCK = time.process_time


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def calibrations(tiny, tmp_path_factory):
    """Three calibrations (files): the tiny model's steps take 0.3-5 ms, where one descheduling or cache flush
    by the other xdist worker moves a knot of the fitted curve; the comparison below takes the median."""
    grid = Grid(prompt_lens=(16, 96), batch_sizes=(1, 8), decode_steps=8, warmup_steps=2)
    paths = []
    for i in range(3):
        path = str(tmp_path_factory.mktemp("cal") / f"cal{i}.json")
        # The engine scope: the comparison below runs the in-process LLMEngine loop (outputs included).
        write(calibrate(tiny, grid, max_seconds=30, seed=i, clock=CLOCK, scope="engine"), path)
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def calibration(calibrations):
    return calibrations[0]


def test_calibration_file_loads(calibration):
    cal = load_calibration(calibration)
    assert cal["version"] == 2 and cal["device"] and cal["dtype"] == "float32"
    assert cal["model"]["num_layers"] == 2 and cal["fit"]["num_samples"] >= 3
    m = StepTimeModel.from_dict(cal["step_time_model"])
    assert m.step_seconds(1, 1, 1, 1) > 0  # a step costs something: the curve was fitted, not clamped away
    assert cal["fit"]["model"] == "token_curve" and len(m.token_curve) >= 3 and cal["scope"] == "engine"


def test_simulated_throughput_within_2x_of_engine(tiny, calibrations):
    from kvserve.runtime.engine.llm_engine import LLMEngine
    from kvserve.runtime.sampling_params import SamplingParams

    concurrency, num_requests, prompt_len, output_len = 4, 16, 48, 12
    engine = LLMEngine.from_kwargs(tiny, max_model_len=128, **ENGINE)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    sent = 0

    def send():
        nonlocal sent
        engine.add_request(f"r{sent}", {"prompt_token_ids": [rng.randrange(3, 512) for _ in range(prompt_len)]}, params)
        sent += 1

    def closed_loop() -> float:
        """Output tokens/s of one closed-loop run: a finished request is replaced by the next one."""
        first = sent
        for _ in range(concurrency):
            send()
        out_tokens, done = 0, 0
        t0 = CLOCK()
        while done < num_requests:
            for o in engine.step():
                if o.finished:
                    done += 1
                    out_tokens += len(o.outputs[0].token_ids)
                    if sent - first < num_requests:
                        send()
        assert out_tokens == num_requests * output_len
        return out_tokens / (CLOCK() - t0)

    # Best of three runs, like the calibration's own timings.
    measured = max(closed_loop() for _ in range(3))
    engine.shutdown()

    workload = Workload(
        LengthSpec(prompt_len, prompt_len),
        LengthSpec(output_len, output_len),
        num_requests,
        concurrency=concurrency,
        seed=0,
    )
    shape = EngineShape(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128)
    predictions = sorted(
        simulate(
            workload, shape, StepTimeModel.from_dict(load_calibration(path)["step_time_model"])
        ).output_tokens_per_s
        for path in calibrations
    )
    predicted = predictions[1]  # the median of the three calibrations
    ratio = predicted / measured
    assert 0.5 <= ratio <= 2.0, f"predicted {predictions} vs measured {measured:.0f} tok/s"


def test_cli_is_registered():
    args = build_parser().parse_args(["calibrate", "/m", "--dtype", "float32", "--out", "c.json", "--max-seconds", "5"])
    assert args.model == "/m" and args.out == "c.json" and args.max_seconds == 5


def test_core_scope_times_the_engine_cores_own_steps(tiny):
    # calibrate()'s default scope "core" (the CLI's is "served"): the seconds come from the engine core's step
    # observer (EngineCore.step), which runs on the wall clock, so another clock is refused rather than mixed in.
    from kvserve.runtime.bench.calibrate import profile
    from kvserve.runtime.engine.llm_engine import LLMEngine

    grid = Grid(prompt_lens=(16,), batch_sizes=(1, 4), decode_steps=4, warmup_steps=2)
    cal = calibrate(tiny, grid, max_seconds=30, seed=0)
    assert cal["scope"] == "core" and cal["fit"]["num_samples"] >= 3
    engine = LLMEngine.from_kwargs(tiny, max_model_len=128, **ENGINE)
    samples = profile(engine, grid, 30, scope="core")
    assert len(samples) >= 3 and all(0 < s.seconds < 5 for s in samples)
    assert engine.core.step_observers == []  # the profiler's observer is gone again
    with pytest.raises(ValueError, match="wall clock"):
        profile(engine, grid, 30, clock=time.process_time, scope="core")
    engine.shutdown()

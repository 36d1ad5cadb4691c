"""The planner's accuracy over a grid of configurations (issue 44 scope 1), measured as the simulators of the
field report it: MAPE of throughput, E2E latency, TTFT and TPOT (p50 and p90), per configuration and overall.

    python -m kvserve.runtime.bench.planner_grid [--quick | --configs NAMES] [--out result.json]
    kvserve bench planner-grid ...   (the same)

For every served model of planner_grid_configs.MODELS that a selected configuration uses: `kvserve serve` starts
on 127.0.0.1 with the step log on (KVSERVE_STEP_LOG), is warmed up, and is calibrated ONCE through itself
(planner_accuracy_served.calibrate_served: a small grid of bursts, the step-time model fitted on the served
core's own steps, the front-end's admission time fitted on the bursts' first steps). Then each configuration's
requests go through the streaming client of `kvserve bench serve` and the same requests (arrival times, lengths,
prompt token ids, so the prefix cache hits alike) through the simulator with that one calibration.

A configuration's error is (predicted - measured) / measured; MAPE is the mean of |error| over configurations.
The client runs on the same cores as the replica, as a load generator beside a pod would not: what the
calibration measured through the server includes that share.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import tempfile
import time

from kvserve.runtime.bench import planner_accuracy as pa
from kvserve.runtime.bench.planner_grid_configs import MODELS, GridConfig, model_config, multi_turn_requests, select
from kvserve.runtime.planner.simulator import LengthSpec, Workload, percentile, simulate

# The reported metrics, in the table's order.
METRICS = ("throughput", "e2e_p50", "e2e_p90", "ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")
# The targets for the overall MAPE (scope 2), beside BLIS's 11.8% E2E / 22.8% TTFT.
TARGETS = {"e2e_p50": 0.10, "tpot_p50": 0.10, "ttft_p50": 0.20}


def summarize(ttft_s: list[float], e2e_s: list[float], tpot_s: list[float], throughput: float) -> dict:
    """The grid's metrics from per-request values (the one percentile definition of simulator.percentile)."""
    return {
        "throughput": throughput,
        "e2e_p50": percentile(e2e_s, 50),
        "e2e_p90": percentile(e2e_s, 90),
        "ttft_p50": percentile(ttft_s, 50),
        "ttft_p90": percentile(ttft_s, 90),
        "tpot_p50": percentile(tpot_s, 50),
        "tpot_p90": percentile(tpot_s, 90),
    }


def errors(predicted: dict, measured: dict) -> dict:
    """(predicted - measured) / measured per metric; None where nothing was measured (e.g. TPOT of 1-token
    outputs)."""
    return {k: (predicted[k] - measured[k]) / measured[k] if measured.get(k) else None for k in METRICS}


def mape(rows: list[dict], key: str = "error") -> dict:
    """Mean |error| per metric over the rows that have one (a fraction: 0.1 = 10%); `key`: which errors
    ("error_drift_removed": with each row's step drift taken out)."""
    out = {}
    for k in METRICS:
        errs = [abs(r[key][k]) for r in rows if r[key].get(k) is not None]
        out[k] = sum(errs) / len(errs) if errs else None
    return out


class ScaledSteps:
    """A step-time model whose every step takes `factor` times as long: the calibration rescaled to the step
    times the replica actually ran during one configuration (its step log), so that what remains of an error
    is the simulator's schedule (queueing, batching, admission), not a machine that got slower or faster
    since it was calibrated (other tenants of a shared machine)."""

    def __init__(self, model, factor: float):
        self.model, self.factor = model, factor

    def step_seconds(self, *work) -> float:
        return self.factor * self.model.step_seconds(*work)


def step_drift(lines: list[dict], step_model) -> float:
    """Measured over predicted seconds of a configuration's logged steps (with the core loop's gaps where the
    core stayed busy, served_steps.with_loop_gaps); 1.0 without steps."""
    from kvserve.runtime.planner.served_steps import with_loop_gaps

    samples = with_loop_gaps(lines)
    predicted = sum(step_model.step_seconds(*s.work) for s in samples)
    return sum(s.seconds for s in samples) / predicted if predicted > 0 else 1.0


def requests_for(config: GridConfig, rng: random.Random, vocab: int, rate: float | None):
    """[(arrival s or None, prompt ids, output len)] of a configuration."""
    if config.turns > 1:
        return multi_turn_requests(config, rng, vocab)
    return pa._requests(config.case, rng, vocab, rate)


def predict(config: GridConfig, requests, step_model, admission_s: float) -> dict:
    """The simulator on the configuration's own requests: their arrivals (a closed loop's stream starts), their
    lengths and their prompt ids."""
    case = config.case
    trace = pa.replay_trace(case, requests)
    w = Workload(
        prompt_len=LengthSpec(case.prompt_len, case.prompt_len),
        output_len=LengthSpec(case.output_len, case.output_len),
        num_requests=len(requests),
        concurrency=case.concurrency,
        trace=trace,
        prompts=tuple(tuple(p) for _, p, _ in requests),
    )
    r = simulate(w, dataclasses.replace(pa.SHAPE, admission_s=admission_s), step_model)
    out = {
        "throughput": r.output_tokens_per_s,
        "e2e_p50": r.e2e_s["p50"],
        "e2e_p90": r.e2e_s["p90"],
        "ttft_p50": r.ttft_s["p50"],
        "ttft_p90": r.ttft_s["p90"],
        "tpot_p50": r.tpot_s["p50"],
        "tpot_p90": r.tpot_s["p90"],
    }
    return {**out, "num_steps": r.num_steps}


def measure(base_url: str, config: GridConfig, requests) -> dict:
    """The requests through the streaming client (planner_accuracy_served._send_all: closed loop over the
    case's ramp, or Poisson arrival delays); the grid's metrics from its records."""
    from kvserve.runtime.bench import planner_accuracy_served as pas
    from kvserve.runtime.bench.serve_client import run_async

    case = dataclasses.replace(config.case, num_requests=len(requests))
    outs, t0 = run_async(pas._send_all(base_url, case, requests))
    failed = [o["error"] for o in outs if not o["success"]]
    if failed:
        raise RuntimeError(f"{config.name}: {len(failed)} requests failed, first: {failed[0]}")
    duration = max(o["start"] + o["e2el"] for o in outs) - t0
    tpot = [(o["e2el"] - o["ttft"]) / (o["output_len"] - 1) for o in outs if o["output_len"] > 1]
    return summarize(
        [o["ttft"] for o in outs], [o["e2el"] for o in outs], tpot, sum(o["output_len"] for o in outs) / duration
    )


def calibration_grid():
    """The one calibration per model: decode batches up to 64 at a short prompt (the GEMM curve) and contexts
    up to 768 tokens at a few requests (the attention terms), 8 output tokens each: about a dozen bursts, so a
    small model calibrates in well under a minute on 2 cores."""
    from kvserve.runtime.bench.calibrate import Grid

    return Grid(
        prompt_lens=(16, 256, 768),
        batch_sizes=(1, 4, 16, 64),
        decode_steps=8,
        warmup_steps=2,
        max_prefill_tokens=4096,
        warm_each_point=False,
    )


def model_dir_for(model, seed: int, workdir: str) -> str:
    """The real default model's folder, or the random shape written under workdir."""
    if model.architecture is None:
        return pa.default_model_dir()
    from kvserve.runtime.models.synthetic import make_random_model_dir

    out = os.path.join(workdir, model.name)
    make_random_model_dir(out, model.architecture, seed=seed, **model_config(model))
    return out


def engine_facts(model_dir: str, tensor_parallel_size: int) -> tuple[int, int]:
    """(KV cache bytes per rank for planner_accuracy.ENGINE's pool, vocab) from the engine config the server
    will build (no weights loaded)."""
    from kvserve.runtime.config import make_engine_config

    cfg = make_engine_config(model_dir, enable_prefix_caching=True, **pa.ENGINE)
    layout = cfg.model.kv_layout(cfg.cache.kv_cache_dtype, cfg.cache.block_size, tensor_parallel_size)
    return layout.bytes_per_token * pa.ENGINE["block_size"] * pa.ENGINE["num_kv_blocks"], cfg.model.vocab_size


def run_model(model, configs: list[GridConfig], model_dir: str, seed: int, progress) -> dict:
    """One server: start, warm up, calibrate once, then measure and predict each configuration."""
    from kvserve.runtime.bench import planner_accuracy_served as pas
    from kvserve.runtime.bench.serve_client import LaunchedServer
    from kvserve.runtime.engine import step_log
    from kvserve.runtime.planner.step_time import StepTimeModel

    kv_bytes, vocab = engine_facts(model_dir, model.tensor_parallel_size)
    args = pas.serve_args(kv_bytes)
    if model.tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(model.tensor_parallel_size)]
    log_path = os.path.join(tempfile.mkdtemp(prefix="kvserve-grid-steps-"), "steps.jsonl")
    rows = []
    with step_log.children_log_to(log_path):  # the server (a child process) inherits it
        t = time.perf_counter()
        with LaunchedServer(model_dir, args) as server:
            progress(f"[{model.name}] server up in {time.perf_counter() - t:.0f} s; warming up")
            pas._warm_server(server.base_url, vocab, seed)
            t = time.perf_counter()
            cal = pas.calibrate_served(server.base_url, log_path, vocab, seed, calibration_grid())
            step_model = StepTimeModel.from_dict(cal["step_time_model"])
            alone_model = StepTimeModel.from_dict(cal["step_time_model_steps_alone"])
            progress(
                f"[{model.name}] calibrated in {time.perf_counter() - t:.0f} s: {cal['fit']['num_samples']} steps, "
                f"mean |rel err| {cal['fit']['mean_abs_rel_error']:.1%}, admission {cal['admission_s'] * 1e3:.2f} ms"
            )
            for config in configs:
                rng = random.Random(f"{seed}-{config.name}")
                case = config.case
                rate = case.load * pa.saturation_rate(case, step_model) if case.load is not None else None
                requests = requests_for(config, rng, vocab, rate)
                steps_before, _ = pas._engine_steps(server.base_url)
                logged = len(step_log.read_lines(log_path))
                t = time.perf_counter()
                measured = measure(server.base_url, config, requests)
                steps_after, _ = pas._engine_steps(server.base_url)
                predicted = predict(config, requests, step_model, cal["admission_s"])
                drift = step_drift(step_log.read_lines(log_path)[logged:], step_model)
                rescaled = predict(config, requests, ScaledSteps(step_model, drift), cal["admission_s"])
                steps_alone = predict(config, requests, alone_model, cal["admission_s"])
                row = {
                    "config": config.name,
                    "model": model.name,
                    "tensor_parallel_size": model.tensor_parallel_size,
                    "request_rate": rate,
                    "num_requests": len(requests),
                    "predicted": predicted,
                    "measured": {**measured, "num_steps": steps_after - steps_before},
                    "seconds": round(time.perf_counter() - t, 1),
                }
                row["error"] = errors(predicted, measured)
                # The same prediction with the calibration rescaled to this configuration's own logged steps:
                # on a shared machine, the schedule's error apart from the machine's drift since calibrating.
                row["step_drift"] = drift
                row["error_drift_removed"] = errors(rescaled, measured)
                # The calibration fitted on the logged steps alone, without the core loop's gaps between them
                # (served_steps.py): what folding the gaps in changes.
                row["error_steps_alone"] = errors(steps_alone, measured)
                rows.append(row)
                progress(line(row))
                progress(line(row, drift_removed=True))
    return {"model": model.name, "calibration": cal, "rows": rows}


def _pct(e: float | None) -> str:
    return "    -" if e is None else f"{e:+5.0%}"


def line(row: dict, drift_removed: bool = False) -> str:
    """A configuration's row: each metric's error, then the step counts (served / simulated). `drift_removed`:
    the errors with the calibration rescaled to the configuration's logged steps (ScaledSteps)."""
    if drift_removed:
        e = row["error_drift_removed"]
        cells = " ".join(f"{_pct(e[k]):>8}" for k in METRICS)
        return f"{'  steps x' + format(row['step_drift'], '.2f') + ' of calibrated ->':<44} {cells}"
    e, p, m = row["error"], row["predicted"], row["measured"]
    rate = f" @{row['request_rate']:.2f}/s" if row["request_rate"] else ""
    return (
        f"{row['config'] + rate:<44} "
        + " ".join(f"{_pct(e[k]):>8}" for k in METRICS)
        + f"   steps {m['num_steps']:.0f}/{p['num_steps']}  ttft p50 {p['ttft_p50'] * 1e3:.0f}/"
        f"{m['ttft_p50'] * 1e3:.0f} ms  ({row['seconds']} s)"
    )


def header() -> str:
    return f"{'configuration (errors: predicted vs measured)':<44} " + " ".join(f"{k:>8}" for k in METRICS)


def overall(rows: list[dict]) -> str:
    def cells(got: dict) -> str:
        return " ".join(f"{'-' if got[k] is None else f'{got[k]:.1%}':>8}" for k in METRICS)

    targets = ", ".join(f"{k} <= {v:.0%}" for k, v in TARGETS.items())
    out = f"{f'MAPE over {len(rows)} configurations':<44} {cells(mape(rows))}"
    if rows and all("error_drift_removed" in r for r in rows):
        out += f"\n{'  with each step drift removed':<44} {cells(mape(rows, 'error_drift_removed'))}"
    if rows and all("error_steps_alone" in r for r in rows):
        out += f"\n{'  calibrated on the steps alone (no gaps)':<44} {cells(mape(rows, 'error_steps_alone'))}"
    return out + f"\n(issue 44 targets: {targets})"


def run(configs: tuple[GridConfig, ...], seed: int = 0, progress=print) -> dict:
    start, load_before = time.perf_counter(), os.getloadavg()
    workdir = tempfile.mkdtemp(prefix="kvserve-grid-")
    per_model = []
    progress(header())
    for model in MODELS:
        mine = [c for c in configs if c.model == model.name]
        if mine:
            per_model.append(run_model(model, mine, model_dir_for(model, seed, workdir), seed, progress))
    rows = [r for m in per_model for r in m["rows"]]
    progress(overall(rows))
    return {
        "mape": mape(rows),
        "mape_drift_removed": mape(rows, "error_drift_removed"),
        "mape_steps_alone": mape(rows, "error_steps_alone"),
        "models": per_model,
        "rows": rows,
        "engine": pa.ENGINE,
        "seconds": round(time.perf_counter() - start, 1),
        "load_average_before": load_before,  # a shared machine moves every timing
        "load_average_after": os.getloadavg(),
        "cpu_count": os.cpu_count(),
    }


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="three configurations of one small model (development)")
    ap.add_argument(
        "--configs",
        default=None,
        help="comma-separated configurations (MODEL/WORKLOAD) or models to run (default: the whole grid)",
    )
    ap.add_argument("--list", action="store_true", help="print the grid's configurations and exit")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random models' weights and of every prompt")
    ap.add_argument("--out", default=None, help="write the result JSON here")


def main_args(args: argparse.Namespace) -> int:
    try:
        configs = select(args.configs, args.quick)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.list:
        for c in configs:
            print(c.name)
        return 0
    result = run(configs, args.seed, progress=lambda msg: print(msg, flush=True))
    print(f"{result['seconds']} s, load average {result['load_average_before']} -> {result['load_average_after']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    return main_args(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

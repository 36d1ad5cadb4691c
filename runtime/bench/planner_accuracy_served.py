"""Planner accuracy through the served engine (issue 25 item 5: "the real served engine, the project's streaming
benchmark"):

    python -m kvserve.runtime.bench.planner_accuracy_served [--model DIR | --random-model] [--seed N] [--out ...]

The model: SmolLM2-135M-Instruct in float32 by default, as planner_accuracy.py.


The calibration is the server's own: `kvserve serve` starts on 127.0.0.1 with the benchmark's settings, KV pool
and KVSERVE_STEP_LOG set (runtime/engine/step_log.py: one line per engine-core step), `kvserve calibrate`'s grid
is sent through it as bursts, and the step-time model is fitted on the logged steps. Then every workload of
planner_accuracy.WORKLOADS is sent through the streaming client of `kvserve bench serve`
(serve_client.send_request: aiohttp, SSE chunks): closed loop as `concurrency` streams started over the workload's
ramp (each sends the next request when its previous one finishes), Poisson as the same arrival times the simulator
is given. TTFT counts from when a
request was sent (its arrival), TPOT is (end-to-end - TTFT) / (tokens - 1), throughput is output tokens over
the time to the last finish, the definitions of the in-process benchmark. What the simulator does not model is
in this measurement: HTTP, detokenising, the API server process and the IPC to the core.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
import time

from kvserve.runtime.bench import planner_accuracy as pa
from kvserve.runtime.planner.simulator import percentile
from kvserve.runtime.planner.step_time import StepTimeModel, fit


def _engine_facts(model_dir: str) -> tuple[int, int]:
    """(KV cache bytes of the benchmark's pool, vocab) from the engine config the server will build (no weights
    are loaded)."""
    from kvserve.runtime.config import make_engine_config

    cfg = make_engine_config(model_dir, enable_prefix_caching=True, **pa.ENGINE)
    layout = cfg.model.kv_layout(cfg.cache.kv_cache_dtype, cfg.cache.block_size, 1)
    return layout.bytes_per_token * pa.ENGINE["block_size"] * pa.ENGINE["num_kv_blocks"], cfg.model.vocab_size


def calibrate_served(
    base_url: str,
    step_log_path: str,
    vocab: int,
    seed: int,
    grid,
    loop_gaps: bool = True,
    shape=None,
    max_seconds: float | None = None,
    progress=None,
) -> dict:
    """`kvserve calibrate`'s grid sent through the server, each point as one burst (`batch` requests of
    `prompt_len` random tokens, `decode_steps` output tokens), fitted on the server's own step log
    (KVSERVE_STEP_LOG, runtime/engine/step_log.py): the served core's steps, with the API server and the client
    beside them. The same bursts give the front-end's admission time (fit_admission). `loop_gaps`: each step
    with the core loop's time after it (served_steps.py; False: the steps alone, as before). `shape`: the
    server's scheduler settings (default planner_accuracy.SHAPE); `max_seconds`: send no further burst after
    this long; `progress`: called with a line per burst."""
    from kvserve.runtime.engine import step_log
    from kvserve.runtime.planner.served_steps import with_loop_gaps

    rng = random.Random(f"{seed}-calibrate")
    start = time.perf_counter()
    seen = len(step_log.read_lines(step_log_path))  # the warm-up's steps
    bursts, samples = [], []  # bursts: (prompt_len, batch, the logged steps' token counts)
    alone = []  # the same steps without the loop's gaps (the fit before served_steps, for comparison)
    points = grid.points()
    for n, (prompt_len, batch) in enumerate(points, 1):
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            if progress:
                progress(f"calibrate: max seconds {max_seconds:g} reached after {n - 1}/{len(points)} grid points")
            break
        burst = pa.Case(f"cal-{prompt_len}x{batch}", prompt_len, grid.decode_steps, batch, concurrency=batch)
        measure_served(base_url, burst, pa._requests(burst, rng, vocab, None))
        new = step_log.read_lines(step_log_path)[seen:]
        seen += len(new)
        # A burst keeps the core busy from its first step to its last: each step's seconds with the core
        # loop's time before the next (served_steps.py), what the simulator's clock advances per step.
        alone += [step_log.sample(d) for d in new]
        samples += with_loop_gaps(new, busy_to_end=True) if loop_gaps else alone[-len(new) :]
        bursts.append((prompt_len, batch, [d["num_tokens"] for d in new]))
        if progress:
            progress(f"calibrate: [{n}/{len(points)}] prompt {prompt_len} x batch {batch}: {len(new)} served steps")
    model, stats = fit(samples)
    admission_s, admission_error = fit_admission(bursts, grid.decode_steps, model, shape or pa.SHAPE)
    return {
        "device": "served engine core",
        "clock": "wall",
        "step_time_model": model.to_dict(),
        "fit": stats,
        "admission_s": admission_s,
        "admission_fit_error": admission_error,
        "loop_gaps": loop_gaps,
        "step_time_model_steps_alone": fit(alone)[0].to_dict() if loop_gaps else model.to_dict(),
    }


# Candidate front-end admission times (seconds per request, simulator.EngineShape.admission_s).
ADMISSION_GRID_S = (0.0, 0.1e-3, 0.25e-3, 0.5e-3, 0.75e-3, 1e-3, 1.5e-3, 2e-3, 3e-3, 4e-3)


def fit_admission(bursts, decode_steps: int, step_model: StepTimeModel, shape=None) -> tuple[float, float]:
    """The admission time whose simulated bursts batch their prefills like the logged ones: the error is the
    tokens of each burst's first three steps, simulated vs logged, over the burst's prompt tokens. A burst sent
    at once reaches the core over time (HTTP, validation, the hand-off, one request after another) and the core
    starts on the first request alone (seen in every logged burst here); what the simulator needs is how many
    follow during each of the first steps."""
    from kvserve.runtime.planner.simulator import LengthSpec, Workload, simulate

    def err(admission_s: float) -> float:
        total = 0.0
        admitting = dataclasses.replace(shape or pa.SHAPE, admission_s=admission_s)
        for prompt_len, batch, logged in bursts:
            w = Workload(
                LengthSpec(prompt_len, prompt_len), LengthSpec(decode_steps, decode_steps), batch, concurrency=batch
            )
            sim = simulate(w, admitting, step_model, record_steps=True).step_tokens
            total += sum(abs(a - b) for a, b in zip(sim[:3] + [0] * 3, logged[:3] + [0] * 3)) / (prompt_len * batch)
        return total / max(1, len(bursts))

    best = min(ADMISSION_GRID_S, key=err)
    return best, err(best)


def serve_args(kv_bytes: int) -> list[str]:
    e = pa.ENGINE
    return [
        "--max-model-len",
        str(e["max_model_len"]),
        "--max-num-seqs",
        str(e["max_num_seqs"]),
        "--max-num-batched-tokens",
        str(e["max_num_batched_tokens"]),
        "--block-size",
        str(e["block_size"]),
        "--kv-cache-bytes",
        str(kv_bytes),
        "--enable-prefix-caching",
    ]


async def _send_all(base_url: str, case: pa.Case, requests, timeout_s: float = 600.0) -> tuple[list[dict], float]:
    """The requests through `kvserve bench serve`'s client (serve_client.send_request): closed loop as streams
    started over the case's ramp (run_closed_loop), Poisson as arrival delays (run_requests). Returns the records
    and the start time."""
    import aiohttp

    from kvserve.runtime.bench.serve_client import Request, run_closed_loop, run_requests, server_info

    reqs = [Request(prompt, olen) for _, prompt, olen in requests]
    url = base_url + "/v1/completions"
    connector = aiohttp.TCPConnector(limit=len(reqs) + 8)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as client:
        model, _ = await server_info(client, base_url, {}, None)
        if case.concurrency is not None:
            outs, t0, _ = await run_closed_loop(client, url, model, reqs, pa.stream_starts(case), {}, timeout_s)
        else:
            delays = [arrival or 0.0 for arrival, _, _ in requests]
            outs, t0, _ = await run_requests(client, url, model, reqs, delays, {}, None, timeout_s)
    return outs, t0


def measure_served(base_url: str, case: pa.Case, requests, ttft_percentiles: tuple[int, ...] = ()) -> dict:
    """The in-process benchmark's three metrics, from the streaming client's records."""
    from kvserve.runtime.bench.serve_client import run_async

    outs, t0 = run_async(_send_all(base_url, case, requests))
    failed = [o["error"] for o in outs if not o["success"]]
    if failed:
        raise RuntimeError(f"{case.name}: {len(failed)} requests failed, first: {failed[0]}")
    duration = max(o["start"] + o["e2el"] for o in outs) - t0
    tpot = [(o["e2el"] - o["ttft"]) / (o["output_len"] - 1) for o in outs if o["output_len"] > 1]
    out = {
        "output_tokens_per_s": sum(o["output_len"] for o in outs) / duration,
        "ttft_p50_s": percentile([o["ttft"] for o in outs], 50),
        "tpot_p50_s": percentile(tpot, 50),
    }
    for q in ttft_percentiles:
        out[f"ttft_p{q}_s"] = percentile([o["ttft"] for o in outs], q)
    return out


def _engine_steps(base_url: str) -> tuple[float, float]:
    """(steps, tokens) the engine has run: vllm:iteration_tokens_total's count and sum."""
    import httpx

    count = total = 0.0
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:iteration_tokens_total_count"):
            count += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:iteration_tokens_total_sum"):
            total += float(line.rsplit(" ", 1)[1])
    return count, total


def _warm_server(base_url: str, vocab: int, seed: int) -> None:
    """The in-process warm-up's requests (planner_accuracy.warm_requests) through the server."""
    requests = [(None, prompt, olen) for prompt, olen in pa.warm_requests(vocab, seed)]
    measure_served(base_url, pa.Case("warm-up", 16, 2, len(requests), concurrency=len(requests)), requests)


def run_served(model_dir: str, seed: int = 0, workloads: tuple[pa.Case, ...] = pa.WORKLOADS, grid=None) -> dict:
    import tempfile

    from kvserve.runtime.bench.serve_client import LaunchedServer
    from kvserve.runtime.engine import step_log

    start, load_before = time.perf_counter(), os.getloadavg()
    kv_bytes, vocab = _engine_facts(model_dir)
    log_path = os.path.join(tempfile.mkdtemp(prefix="kvserve-steps-"), "steps.jsonl")
    rows = []
    with step_log.children_log_to(log_path):  # the server (a child process) inherits it
        with LaunchedServer(model_dir, serve_args(kv_bytes)) as server:
            _warm_server(server.base_url, vocab, seed)
            calibration = calibrate_served(server.base_url, log_path, vocab, seed, grid or pa._grid())
            step_model = StepTimeModel.from_dict(calibration["step_time_model"])
            print(f"front-end admission {calibration['admission_s'] * 1e3:.2f} ms per request", flush=True)
            for case in workloads:
                rng = random.Random(f"{seed}-{case.name}")  # a seed per workload: see planner_accuracy.run
                rate = case.load * pa.saturation_rate(case, step_model) if case.load is not None else None
                requests = pa._requests(case, rng, vocab, rate)
                steps_before, tokens_before = _engine_steps(server.base_url)
                measured = measure_served(server.base_url, case, requests)
                steps_after, tokens_after = _engine_steps(server.base_url)
                predicted = pa.predict(case, requests, step_model, calibration["admission_s"])
                rows.append(pa.row(case, rate, predicted, measured))
                # Beside the metrics: the steps and tokens the server's engine ran for this workload (the
                # simulator's step count is in the prediction), to tell a slower step from another schedule.
                rows[-1]["measured_engine"] = {
                    "steps": steps_after - steps_before,
                    "tokens": tokens_after - tokens_before,
                }
                print(
                    pa._line(rows[-1]),
                    f"(steps: {steps_after - steps_before:.0f} served, {rows[-1]['predicted']['num_steps']} simulated)",
                    flush=True,
                )
    return {
        "mode": "served",
        "clock": "wall",
        "calibration": calibration,
        "engine": pa.ENGINE,
        "rows": rows,
        "seconds": round(time.perf_counter() - start, 1),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct, float32)")
    ap.add_argument("--random-model", action="store_true", help="build the random-weight 125M Llama instead")
    ap.add_argument("--out", help="write the result JSON here")
    ap.add_argument("--seed", type=int, default=0, help="seed of the model's weights and of every workload's prompts")
    args = ap.parse_args(argv)
    if args.model and args.random_model:
        ap.error("--model and --random-model exclude each other")
    model_dir = args.model or (pa.random_model_dir(args.seed) if args.random_model else pa.default_model_dir())
    print("workload                     predicted / measured (error)", flush=True)
    return pa.finish(run_served(model_dir, args.seed), args.out)


if __name__ == "__main__":
    sys.exit(main())

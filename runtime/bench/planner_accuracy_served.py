"""Planner accuracy through the served engine (issue 25 item 5: "the real served engine, the project's streaming
benchmark"):

    python -m kvserve.runtime.bench.planner_accuracy_served [--model DIR] [--seed N] [--out result.json]


The calibration is `kvserve calibrate`'s profile of an in-process engine on the wall clock, with the intra-op
thread count the served engine core runs with (core_process.core_cpu_threads: all cores but one on CPU, the
last one left to the API server). That engine is shut down, then `kvserve serve` starts on 127.0.0.1 with the
same settings and KV pool, and every workload of planner_accuracy.WORKLOADS is sent through the streaming
client of `kvserve bench serve` (serve_client.send_request: aiohttp, SSE chunks): closed loop as a semaphore
of `concurrency` (the next request leaves when one finishes), Poisson as the same arrival times the simulator
is given. TTFT counts from when a request was sent (its arrival), TPOT is (end-to-end - TTFT) / (tokens - 1),
throughput is output tokens over the time to the last finish, the definitions of the in-process benchmark.
What the simulator does not model is in this measurement: HTTP, tokenizer-free detokenising, the API server
process and the IPC to the core, on a machine whose second core is the API server's.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

from kvserve.runtime.bench import planner_accuracy as pa
from kvserve.runtime.planner.simulator import percentile
from kvserve.runtime.planner.step_time import StepTimeModel, fit


def _calibrate(model_dir: str, seed: int, grid) -> tuple[dict, int, int]:
    """(calibration, KV cache bytes of the benchmark's pool, vocab) from an in-process engine on the core's
    thread count; the engine is shut down before the server starts."""
    import gc

    import torch

    from kvserve.runtime.bench.calibrate import device_name, profile
    from kvserve.runtime.engine.core_process import core_cpu_threads
    from kvserve.runtime.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_kwargs(model_dir, enable_prefix_caching=True, **pa.ENGINE)
    threads_before = torch.get_num_threads()
    threads = core_cpu_threads(engine.config)
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        cfg = engine.config
        vocab = cfg.model.vocab_size
        pa.warm_up(engine, vocab, seed)
        model, stats = fit(profile(engine, grid or pa._grid(), 180, seed, time.perf_counter))
        layout = cfg.model.kv_layout(cfg.cache.kv_cache_dtype, cfg.cache.block_size, 1)
        kv_bytes = layout.bytes_per_token * pa.ENGINE["block_size"] * pa.ENGINE["num_kv_blocks"]
        calibration = {
            "device": device_name(engine),
            "clock": "wall",
            "threads": threads or threads_before,
            "step_time_model": model.to_dict(),
            "fit": stats,
        }
    finally:
        engine.shutdown()
        torch.set_num_threads(threads_before)
    del engine
    gc.collect()
    return calibration, kv_bytes, vocab


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


async def _send_all(base_url: str, case: pa.Case, requests, timeout_s: float = 600.0) -> list[dict]:
    import asyncio

    import aiohttp

    from kvserve.runtime.bench.serve_client import Request, send_request, server_info

    reqs = [Request(prompt, olen) for _, prompt, olen in requests]
    connector = aiohttp.TCPConnector(limit=len(reqs) + 8)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as client:
        model, _ = await server_info(client, base_url, {}, None)
        url = base_url + "/v1/completions"
        gate = asyncio.Semaphore(case.concurrency) if case.concurrency is not None else None
        t0 = time.perf_counter()

        async def one(req, arrival: float | None) -> dict:
            if gate is None:
                await asyncio.sleep(max(0.0, t0 + arrival - time.perf_counter()))
                return await send_request(client, url, model, req, {}, timeout_s)
            async with gate:
                return await send_request(client, url, model, req, {}, timeout_s)

        outs = await asyncio.gather(*(one(r, a) for r, (a, _, _) in zip(reqs, requests, strict=True)))
    for o in outs:
        o["t0"] = t0
    return list(outs)


def measure_served(base_url: str, case: pa.Case, requests, ttft_percentiles: tuple[int, ...] = ()) -> dict:
    """The in-process benchmark's three metrics, from the streaming client's records."""
    from kvserve.runtime.bench.serve_client import run_async

    outs = run_async(_send_all(base_url, case, requests))
    failed = [o["error"] for o in outs if not o["success"]]
    if failed:
        raise RuntimeError(f"{case.name}: {len(failed)} requests failed, first: {failed[0]}")
    t0 = outs[0]["t0"]
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


# The front-end admission probe: a burst of requests at an idle server (none of the table's workloads). How far
# apart the requests reach the engine decides how the first steps are batched (one request's prefill alone,
# then the rest), which the simulator models as a FIFO front-end of admission_s per request.
PROBE = pa.Case("admission-probe", 32, 2, 64, concurrency=64)
ADMISSION_GRID_S = (0.0, 0.25e-3, 0.5e-3, 1e-3, 1.5e-3, 2e-3, 3e-3, 4e-3, 6e-3, 8e-3, 12e-3)


def fit_admission(base_url: str, vocab: int, seed: int, step_model: StepTimeModel) -> dict:
    """admission_s from the grid whose simulated TTFT p50 and p90 of the probe burst are closest (sum of
    relative errors) to the served ones."""
    requests = pa._requests(PROBE, random.Random(f"{seed}-{PROBE.name}"), vocab, None)
    measured = measure_served(base_url, PROBE, requests, ttft_percentiles=(90,))

    def err(admission_s: float) -> float:
        sim = pa.predict(PROBE, requests, step_model, admission_s)["ttft_s"]
        pairs = ((sim["p50"], measured["ttft_p50_s"]), (sim["p90"], measured["ttft_p90_s"]))
        return sum(abs(p - m) / m for p, m in pairs)

    best = min(ADMISSION_GRID_S, key=err)
    return {"admission_s": best, "probe_error": err(best), "probe_measured": measured}


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
    """The in-process warm-up's shapes through the server (oneDNN primitives per batch and chunk shape)."""
    rng = random.Random(f"{seed}-warm-served")
    requests = [
        (None, [rng.randrange(3, vocab) for _ in range(rng.randint(16, 300))], rng.randint(2, 8)) for _ in range(128)
    ]
    measure_served(base_url, pa.Case("warm-up", 16, 2, 128, concurrency=128), requests)


def run_served(model_dir: str, seed: int = 0, workloads: tuple[pa.Case, ...] = pa.WORKLOADS, grid=None) -> dict:
    from kvserve.runtime.bench.serve_client import LaunchedServer

    start, load_before = time.perf_counter(), os.getloadavg()
    calibration, kv_bytes, vocab = _calibrate(model_dir, seed, grid)
    step_model = StepTimeModel.from_dict(calibration["step_time_model"])
    rows = []
    with LaunchedServer(model_dir, serve_args(kv_bytes)) as server:
        _warm_server(server.base_url, vocab, seed)
        front_end = fit_admission(server.base_url, vocab, seed, step_model)
        calibration["front_end"] = front_end
        print(f"front-end admission {front_end['admission_s'] * 1e3:.2f} ms per request", flush=True)
        for case in workloads:
            rng = random.Random(f"{seed}-{case.name}")  # a seed per workload: see planner_accuracy.run
            rate = case.load * pa.saturation_rate(case, step_model) if case.load is not None else None
            requests = pa._requests(case, rng, vocab, rate)
            steps_before, tokens_before = _engine_steps(server.base_url)
            measured = measure_served(server.base_url, case, requests)
            steps_after, tokens_after = _engine_steps(server.base_url)
            predicted = pa.predict(case, requests, step_model, front_end["admission_s"])
            rows.append(pa.row(case, rate, predicted, measured))
            # Diagnostics beside the metrics: steps and tokens the server's engine ran for this workload (the
            # simulator's counts are in the prediction), to tell a slower step from a different schedule.
            rows[-1]["measured_engine"] = {"steps": steps_after - steps_before, "tokens": tokens_after - tokens_before}
            print(
                pa._line(rows[-1]),
                rows[-1]["measured_engine"],
                "sim steps",
                rows[-1]["predicted"].get("num_steps"),
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
    ap.add_argument("--model", help="model folder (default: build the random-weight 125M Llama)")
    ap.add_argument("--out", help="write the result JSON here")
    ap.add_argument("--seed", type=int, default=0, help="seed of the model's weights and of every workload's prompts")
    args = ap.parse_args(argv)
    model_dir = args.model or pa.default_model_dir(args.seed)
    print("workload                     predicted / measured (error)", flush=True)
    return pa.finish(run_served(model_dir, args.seed), args.out)


if __name__ == "__main__":
    sys.exit(main())

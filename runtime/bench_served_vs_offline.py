"""`kvserve bench serve --compare served-vs-offline`: the same workload offline and through `kvserve serve`, in
one run, so the serving stack's own cost shows as a ratio against a peer measured minutes apart on the same
(possibly shared) machine.

1. offline: an in-process LLMEngine on the same model and engine flags (`--serve-args`), the same prompts
   (token ids from the same seed), greedy, ignore_eos; every step timed. "Offline step time" is the median
   step with the whole batch decoding, which is what a served stream's TPOT would be if serving cost nothing.
2. served, engine core in the server process (`kvserve serve --inprocess-engine`: the layout before the
   engine-core process existed);
3. served, engine core in its own process (`kvserve serve`, the default).
Printed: output tok/s of each, served/offline throughput ratios, and median TPOT / offline step time.
Goals (issue 10): ratio >= 0.9 at 256 concurrent streams on the demo model; TPOT within 1.15x of the step.
"""
from __future__ import annotations

import argparse
import statistics
import time


def offline_run(args: argparse.Namespace, model_dir: str, serve_args: list[str]) -> dict:
    import random

    from kvserve.runtime.bench_serve import _Request, random_workload
    from kvserve.runtime.config import build_engine_config
    from kvserve.runtime.engine.llm_engine import LLMEngine
    from kvserve.runtime.engine_args import EngineArgs
    from kvserve.runtime.sampling_params import SamplingParams

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    namespace, _ = parser.parse_known_args(serve_args)  # server-only flags (--port ...) do not apply
    engine = LLMEngine(build_engine_config(EngineArgs.from_cli_args(model_dir, namespace)))
    try:
        vocab = len(engine.tokenizer)  # what the server reports in /v1/models: the same prompts
        requests, warm = random_workload(args, random.Random(args.seed), vocab)
        _generate(engine, [warm], SamplingParams)
        start = time.perf_counter()
        steps = _generate(engine, requests, SamplingParams)
        wall_s = time.perf_counter() - start
    finally:
        engine.shutdown()
    total_out = sum(r.output_len for r in requests)
    full = [dt for dt, running in steps if running == len(requests)] or [dt for dt, _ in steps]
    return {"duration_s": wall_s, "total_output_tokens": total_out, "output_throughput": total_out / wall_s,
            "num_steps": len(steps), "median_step_ms": statistics.median(dt for dt, _ in steps) * 1000,
            "median_full_batch_step_ms": statistics.median(full) * 1000, "num_full_batch_steps": len(full)}


def _generate(engine, requests: list, params_type) -> list[tuple[float, int]]:
    """Run `requests` to completion; (seconds, requests running) per step."""
    for i, req in enumerate(requests):
        engine.add_request(f"offline-{id(requests)}-{i}", list(req.prompt),
                           params_type(max_tokens=req.output_len, temperature=0.0, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - t0, engine.scheduler.num_running))
    return steps


def compare(args: argparse.Namespace, slos: dict[str, float]) -> dict:
    import asyncio
    import shlex

    from kvserve.runtime.bench_serve import _LaunchedServer, _print_result, _run_workload
    from kvserve.runtime.demo_model import ensure_demo_model

    args.workload = "random"
    model_dir = args.model_dir or str(ensure_demo_model())
    serve_args = shlex.split(args.serve_args)
    print(f"== offline: LLMEngine({model_dir}, {' '.join(serve_args)})")
    offline = offline_run(args, model_dir, serve_args)
    print("   " + ", ".join(f"{k}={_fmt(v)}" for k, v in offline.items()))
    runs = {"offline": offline}
    for label, extra in (("served, core in the server process", ["--inprocess-engine"]),
                         ("served, core in its own process", [])):
        with _LaunchedServer(model_dir, serve_args + extra) as server:
            print(f"== {label}: kvserve serve {' '.join(serve_args + extra)}")
            result = asyncio.run(_run_workload(args, server.base_url, slos, label=label))
            _print_result(result)
            runs[label] = result
    rows = []
    for label in list(runs)[1:]:
        m = runs[label]["metrics"]
        rows.append({
            "run": label, "output_tok_s": m["output_throughput"],
            "served_over_offline": m["output_throughput"] / offline["output_throughput"],
            "median_tpot_ms": m["median_tpot_ms"],
            "tpot_over_offline_step": m["median_tpot_ms"] / offline["median_full_batch_step_ms"],
            "failed": m["failed"]})
    print(f"== served vs offline ({args.num_prompts} prompts, max concurrency {args.max_concurrency}); offline "
          f"{offline['output_throughput']:.0f} tok/s, median full-batch step {offline['median_full_batch_step_ms']:.1f} ms")
    print(f"{'run':<40} {'tok/s':>8} {'ratio':>7} {'TPOT ms':>8} {'TPOT/step':>9}")
    for row in rows:
        print(f"{row['run']:<40} {row['output_tok_s']:>8.0f} {row['served_over_offline']:>7.2f} "
              f"{row['median_tpot_ms']:>8.1f} {row['tpot_over_offline_step']:>9.2f}")
    after = rows[-1]
    summary = {"rows": rows, "goal": "served/offline >= 0.9 and TPOT <= 1.15x offline step (core process)",
               "goal_met": after["served_over_offline"] >= 0.9 and after["tpot_over_offline_step"] <= 1.15}
    print(f"goal met: {summary['goal_met']}")
    return {"compare": "served-vs-offline", "summary": summary, "runs": runs}


def _fmt(value) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)

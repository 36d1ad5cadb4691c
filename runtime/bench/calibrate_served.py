"""`kvserve calibrate`'s default scope, "served" (issue 44 scope 5): calibrate what a served replica runs.

It starts `kvserve serve MODEL` on 127.0.0.1 with the step log on (KVSERVE_STEP_LOG), warms it up, sends the
calibration grid through it as bursts from this process (a client beside the server, as a load generator or
the API server's own work shares a replica's cores), and fits the step-time model on the served core's own
steps, each with the core loop's time before the next step (planner/served_steps.py): the step-to-step period
of a served replica, which the in-process profile (scope "core") misses. The burst schedules also give the
front-end's admission time (planner_accuracy_served.fit_admission), which the calibration file carries.
"""

from __future__ import annotations

import os
import tempfile
import time


def serve_args(grid, dtype: str | None) -> list[str]:
    """`kvserve serve`'s flags for the grid: every burst admitted at once, every prompt a real prefill."""
    max_prompt, max_batch = max(grid.prompt_lens), max(grid.batch_sizes)
    args = [
        "--max-model-len",
        str(max_prompt + grid.decode_steps + 1),
        "--max-num-seqs",
        str(max_batch),
        "--max-num-batched-tokens",
        str(max(2048, max_prompt)),
        "--no-enable-prefix-caching",
    ]
    if dtype:
        args += ["--dtype", dtype]
    return args


def engine_shape(grid):
    """The simulator's EngineShape of serve_args' server (its KV pool is not what the bursts are limited by)."""
    from kvserve.runtime.planner.simulator import EngineShape

    max_prompt, max_batch = max(grid.prompt_lens), max(grid.batch_sizes)
    tokens = max_batch * (max_prompt + grid.decode_steps + 1)
    return EngineShape(
        num_blocks=tokens // 16 + max_batch + 2,
        block_size=16,
        max_num_seqs=max_batch,
        max_num_batched_tokens=max(2048, max_prompt),
        max_model_len=max_prompt + grid.decode_steps + 1,
        enable_prefix_caching=False,
    )


def warm_up(base_url: str, grid, vocab: int, seed: int, deadline: float) -> None:
    """Each grid point's burst once, unrecorded (Grid.warm_each_point: a shape's first step pays one-time costs a
    long-running server has paid), else only the smallest; no further burst after `deadline` (perf_counter)."""
    import random

    from kvserve.runtime.bench import planner_accuracy as pa
    from kvserve.runtime.bench import planner_accuracy_served as pas

    rng = random.Random(f"{seed}-warm")
    points = grid.points() if grid.warm_each_point else grid.points()[:1]
    for prompt_len, batch in points:
        if time.perf_counter() > deadline:
            break
        burst = pa.Case(f"warm-{prompt_len}x{batch}", prompt_len, grid.decode_steps, batch, concurrency=batch)
        pas.measure_served(base_url, burst, pa._requests(burst, rng, vocab, None))


def calibrate(
    model_dir: str | None,
    grid,
    max_seconds: float = 180.0,
    seed: int = 0,
    dtype: str | None = None,
    progress=print,
) -> dict:
    """Start a replica, calibrate through it, stop it; returns `kvserve calibrate`'s calibration dict. The
    replica runs on `kvserve serve`'s device (a GPU when there is one, else the CPU)."""
    from kvserve.runtime.bench import planner_accuracy_served as pas
    from kvserve.runtime.bench.calibrate import calibration_header
    from kvserve.runtime.bench.serve_client import LaunchedServer
    from kvserve.runtime.config import make_engine_config
    from kvserve.runtime.engine import step_log

    if model_dir is None:
        from kvserve.runtime.demo_model import ensure_demo_model

        model_dir = str(ensure_demo_model())
    kwargs = {"dtype": dtype} if dtype else {}
    cfg = make_engine_config(model_dir, max_model_len=max(grid.prompt_lens) + grid.decode_steps + 1, **kwargs)
    log_path = os.path.join(tempfile.mkdtemp(prefix="kvserve-calibrate-"), "steps.jsonl")
    start = time.perf_counter()
    with step_log.children_log_to(log_path):  # the server (a child process) inherits it
        with LaunchedServer(model_dir, serve_args(grid, dtype)) as server:
            progress(f"calibrate: kvserve serve up in {time.perf_counter() - start:.0f} s; warming up")
            warm_up(server.base_url, grid, cfg.model.vocab_size, seed, deadline=time.perf_counter() + max_seconds / 2)
            served = pas.calibrate_served(
                server.base_url,
                log_path,
                cfg.model.vocab_size,
                seed,
                grid,
                shape=engine_shape(grid),
                max_seconds=max_seconds,
                progress=progress,
            )
    return {
        **calibration_header(cfg, model_dir, grid),
        "device": _device_name(cfg.device),
        "step_time_model": served["step_time_model"],
        "fit": served["fit"],
        "admission_s": served["admission_s"],
        "admission_fit_error": served["admission_fit_error"],
        "measured_seconds": round(time.perf_counter() - start, 3),
        "clock": "wall",
        "scope": "served",
    }


def _device_name(engine_device: str) -> str:
    if engine_device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(engine_device)
    from kvserve.runtime.bench.cpu_pinning import machine_info

    return machine_info().get("cpu_model") or "unknown"

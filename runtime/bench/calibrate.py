"""`kvserve calibrate`: measure a step-time model (runtime/planner/step_time) on this machine's engine.

It drives the real `LLMEngine` over a small grid of (prompt tokens, decode batch): each grid point adds
`batch` requests with random token-id prompts (greedy, ignore_eos, `decode_steps` output tokens) and steps
the engine until they finish. Every step is timed whole (`engine.step()`, the time the planner simulates)
and recorded with what the scheduler gave it: the tokens computed and the context tokens attended, the two
variables of the linear model. Prefill steps give large token counts, decode steps at growing contexts give
the attention term. The fit and its residuals go to a JSON file `kvserve plan --calibration` reads.
Engine-driving code lives here (torch), not in runtime/planner (torch-free contract).
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass

from kvserve.runtime.planner.predict import CALIBRATION_VERSION
from kvserve.runtime.planner.step_time import StepSample, fit, step_work


@dataclass(frozen=True)
class Grid:
    """The profiled (prompt tokens, requests) points: every pair of the two lists whose prompts total at most
    max_prefill_tokens, so the decode batches reach the largest batch at the shortest prompt (the GEMM curve
    up to max_num_seqs rows) while long prompts stay at a few requests (the attention terms)."""

    prompt_lens: tuple[int, ...] = (32, 256, 1024)
    batch_sizes: tuple[int, ...] = (1, 4, 16, 64, 256)
    decode_steps: int = 16
    warmup_steps: int = 3  # steps of a first, unrecorded run (allocator, thread pools)
    max_prefill_tokens: int = 16384
    # Run each point once unrecorded first: a shape's first step pays one-time costs (oneDNN primitive
    # creation, allocator growth; 10-15x a warm step on CPU) that a long-running server does not. An engine
    # warmed up over these shapes already (the accuracy benchmark) can skip it.
    warm_each_point: bool = True

    def points(self) -> list[tuple[int, int]]:
        smallest = min(self.prompt_lens)
        return [
            (p, b)
            for p in sorted(self.prompt_lens)
            for b in sorted(self.batch_sizes)
            if p * b <= self.max_prefill_tokens or p == smallest and b == min(self.batch_sizes)
        ]


def device_name(engine) -> str:
    """The GPU's name, or the CPU's model name (cpu_pinning.machine_info reads it from /proc/cpuinfo)."""
    runner_device = engine.executor.runner.device
    if runner_device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(runner_device)
    from kvserve.runtime.bench.cpu_pinning import machine_info

    return machine_info().get("cpu_model") or "unknown"


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# What a step's seconds cover. "core": the engine core's step (schedule, forward, sample, update), what a served
# engine's core process runs per step while the API server detokenises and streams on another core; the
# default of `kvserve calibrate`, whose plans are for served replicas. "engine": LLMEngine.step, the core step plus
# turning its outputs into RequestOutputs (detokenising) in the same thread, what an offline/in-process loop
# runs. Measured here: 15% apart on small decode batches of the 125M model (docs/planner.md).
SCOPES = ("core", "engine")


class _CoreSteps:
    """A step observer on the engine core (EngineCore.step_observers): the last step's scheduled requests and
    its seconds (the core step's own wall time)."""

    def __init__(self):
        self.scheduled, self.seconds = None, 0.0

    def __call__(self, scheduled, seconds: float) -> None:
        self.scheduled, self.seconds = scheduled, seconds


def _run_point(
    engine,
    core: _CoreSteps,
    prompt_len: int,
    batch: int,
    decode_steps: int,
    rng,
    tag: str,
    clock=time.perf_counter,
    scope: str = "core",
) -> list[StepSample]:
    from kvserve.runtime.sampling_params import SamplingParams

    vocab = engine.config.model.vocab_size
    params = SamplingParams(temperature=0, max_tokens=decode_steps, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        engine.add_request(f"cal-{tag}-{i}", {"prompt_token_ids": prompt}, params)
    samples = []
    while engine.has_unfinished_requests():
        core.scheduled = None
        t = clock()
        engine.step()
        seconds = clock() - t
        if not core.scheduled:
            continue
        # The core's own seconds are wall time (perf_counter): with another clock (the accuracy benchmark's
        # CPU time) the engine scope is the one to use.
        samples.append(StepSample.of(step_work(core.scheduled), core.seconds if scope == "core" else seconds))
    return samples


def profile(
    engine, grid: Grid, max_seconds: float, seed: int = 0, clock=time.perf_counter, scope: str = "core"
) -> list[StepSample]:
    """Time every step of the grid's runs on `engine` (one the caller built: `calibrate` below, or a benchmark
    that measures the same engine afterwards); `scope`: see SCOPES."""
    if scope not in SCOPES:
        raise ValueError(f"scope: one of {', '.join(SCOPES)}, got {scope!r}")
    if scope == "core" and clock is not time.perf_counter:
        raise ValueError("scope core: the engine core times its steps on the wall clock; use scope engine")
    core = _CoreSteps()
    engine.core.step_observers.append(core)
    rng = random.Random(seed)
    start = time.perf_counter()
    _run_point(engine, core, min(grid.prompt_lens), 1, grid.warmup_steps, rng, "warmup")
    samples: list[StepSample] = []
    points = grid.points()
    for n, (prompt_len, batch) in enumerate(points, 1):
        if time.perf_counter() - start > max_seconds:
            _progress(f"calibrate: --max-seconds {max_seconds:g} reached after {n - 1}/{len(points)} grid points")
            break
        if grid.warm_each_point:
            _run_point(engine, core, prompt_len, batch, grid.decode_steps, rng, f"{n}-warm", clock, scope)
        got = _run_point(engine, core, prompt_len, batch, grid.decode_steps, rng, f"{n}", clock, scope)
        samples += got
        _progress(
            f"calibrate: [{n}/{len(points)}] prompt {prompt_len} x batch {batch}: {len(got)} steps, "
            f"median {1e3 * sorted(s.seconds for s in got)[len(got) // 2]:.2f} ms"
        )
    engine.core.step_observers.remove(core)
    return samples


def calibrate(
    model_dir: str | None = None,
    grid: Grid = Grid(),
    max_seconds: float = 180.0,
    seed: int = 0,
    clock=time.perf_counter,
    scope: str = "core",
    **engine_kwargs,
) -> dict:
    """Measure and fit; returns the calibration dict (version, device, model, coefficients, residuals).
    `clock`: what a step's seconds are read from (wall time; the accuracy benchmark can pass the process's
    CPU time, which other tenants of a shared machine do not move)."""
    from kvserve.runtime.engine.llm_engine import LLMEngine

    if model_dir is None:
        from kvserve.runtime.demo_model import ensure_demo_model

        model_dir = str(ensure_demo_model())
    max_prompt, max_batch = max(grid.prompt_lens), max(grid.batch_sizes)
    max_model_len = max_prompt + grid.decode_steps + 1
    kwargs = dict(
        max_model_len=max_model_len,
        max_num_seqs=max_batch,
        max_num_batched_tokens=max(2048, max_prompt),
        enable_prefix_caching=False,  # random prompts anyway; keep every prefill a real prefill
    )
    kwargs.update(engine_kwargs)
    engine = LLMEngine.from_kwargs(model_dir, **kwargs)
    start = time.perf_counter()
    samples = profile(engine, grid, max_seconds, seed, clock, scope)
    cfg = engine.config
    device = device_name(engine)
    engine.shutdown()
    model, residuals = fit(samples)
    return {
        **calibration_header(cfg, model_dir, grid),
        "device": device,
        "step_time_model": model.to_dict(),
        "fit": residuals,
        "measured_seconds": round(time.perf_counter() - start, 3),
        "clock": getattr(clock, "__name__", str(clock)),
        "scope": scope,
    }


def calibration_header(cfg, model_dir: str, grid: Grid) -> dict:
    """What a calibration file says about what was measured, whichever scope measured it: the format version,
    the engine's device kind (`kvserve plan` plans a CPU server for a CPU one), the model's shape, the grid."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        kvserve_version = version("kvserve")
    except PackageNotFoundError:
        kvserve_version = "unknown"
    return {
        "version": CALIBRATION_VERSION,
        "engine_device": cfg.device,
        "model": {
            "dir": model_dir,
            "architecture": cfg.model.architecture,
            "num_layers": cfg.model.num_layers,
            "num_heads": cfg.model.num_heads,
            "num_kv_heads": cfg.model.num_kv_heads,
            "head_dim": cfg.model.head_dim,
            "hidden_size": cfg.model.hidden_size,
            "vocab_size": cfg.model.vocab_size,
        },
        "dtype": cfg.model.dtype,
        "kvserve_version": kvserve_version,
        "grid": {
            "prompt_lens": list(grid.prompt_lens),
            "batch_sizes": list(grid.batch_sizes),
            "decode_steps": grid.decode_steps,
        },
    }


def write(calibration: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(calibration, f, indent=2)
        f.write("\n")

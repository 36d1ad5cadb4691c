"""`kvserve calibrate MODEL`: measure this machine's step-time model for `kvserve plan --calibration`."""

from __future__ import annotations

import argparse

from kvserve.cli.errors import CLIError

HELP = "measure a step-time model (GEMM curve over tokens, LM head, attention) for kvserve plan --calibration"


def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise CLIError(f"{name}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise CLIError(f"{name}: every value must be >= 1, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="local HF model dir (default: the built-in demo model)")
    parser.add_argument("--dtype", default=None, help="weights/activation dtype (default: the model's)")
    parser.add_argument("--device", default=None, help="e.g. cuda (default: the engine's default)")
    parser.add_argument("--out", default="calibration.json", help="where to write the calibration JSON")
    parser.add_argument("--max-seconds", type=float, default=180.0, help="stop measuring new grid points after this")
    parser.add_argument("--prompt-lens", default="32,256,1024", help="grid: prompt tokens, comma-separated")
    parser.add_argument(
        "--batch-sizes", default="1,4,16,64,256", help="grid: requests decoding together, comma-separated"
    )
    parser.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=16384,
        help="grid: skip (prompt, batch) points whose prompts total more tokens (long prompts at small batches)",
    )
    parser.add_argument("--decode-steps", type=int, default=16, help="output tokens per request at each grid point")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the measured prompts")
    parser.add_argument(
        "--scope",
        choices=["served", "core", "engine"],
        default="served",
        help="what is measured: served = a `kvserve serve` replica started on 127.0.0.1, the grid sent through "
        "it, fitted on its core's logged steps with the core loop's time between them (what a served replica "
        "runs beside its API server and clients); core = an in-process engine core's steps alone; engine = "
        "LLMEngine.step with its outputs (the offline LLM, in-process)",
    )
    parser.add_argument(
        "--from-step-log",
        default=None,
        metavar="PATH",
        help="fit the step log of a running replica (KVSERVE_STEP_LOG=PATH kvserve serve ...: the served core's "
        "own steps beside its API server) instead of profiling an in-process engine; MODEL and the grid are unused; "
        "--device names the replica's device (default: this machine's, as kvserve serve picks it)",
    )


def from_step_log(path: str, device: str | None = None) -> dict:
    """A calibration fitted on a served replica's step log (runtime/engine/step_log.py), in `kvserve calibrate`'s
    format: what the replica's core measured while it served, rather than an offline profile; each step with
    the core loop's time before the next where the core stayed busy (planner/served_steps.py). `device`: the
    replica's (cpu, cuda; default: what `kvserve serve` picks on this machine), so `kvserve plan` knows
    whether to plan a CPU server. Raises CLIError naming the flag when the log cannot be read or holds too few
    steps."""
    from kvserve.runtime.engine import step_log
    from kvserve.runtime.planner.predict import CALIBRATION_VERSION
    from kvserve.runtime.planner.served_steps import with_loop_gaps
    from kvserve.runtime.planner.step_time import fit

    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        samples = with_loop_gaps(step_log.read_lines(path))
    except OSError as exc:
        raise CLIError(f"--from-step-log: cannot read {path}: {exc.strerror}") from None
    except (KeyError, TypeError) as exc:
        raise CLIError(f"--from-step-log: {path} is not a step log (a line lacks {exc})") from None
    try:
        model, residuals = fit(samples)
    except ValueError as exc:
        raise CLIError(f"--from-step-log: {path}: {exc}") from None
    return {
        "version": CALIBRATION_VERSION,
        "device": "served engine core",
        "engine_device": device,
        "clock": "wall",
        "scope": "served",
        "step_log": path,
        "step_time_model": model.to_dict(),
        "fit": residuals,
    }


def _progress(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from kvserve.runtime.bench import calibrate

    if args.from_step_log is not None:
        cal = from_step_log(args.from_step_log, args.device)
        calibrate.write(cal, args.out)
        print(f"wrote {args.out}: fitted on {cal['fit']['num_samples']} served steps of {args.from_step_log}")
        return 0
    if args.decode_steps < 1:
        raise CLIError("--decode-steps: must be >= 1")
    grid = calibrate.Grid(
        prompt_lens=_ints(args.prompt_lens, "--prompt-lens"),
        batch_sizes=_ints(args.batch_sizes, "--batch-sizes"),
        decode_steps=args.decode_steps,
        max_prefill_tokens=args.max_prefill_tokens,
    )
    if args.scope == "served":
        from kvserve.runtime.bench import calibrate_served

        if args.device:
            raise CLIError("--device: the served scope runs `kvserve serve`'s device; give --scope core for another")
        cal = calibrate_served.calibrate(
            args.model, grid, max_seconds=args.max_seconds, seed=args.seed, dtype=args.dtype, progress=_progress
        )
    else:
        engine_kwargs = {k: v for k, v in (("dtype", args.dtype), ("device", args.device)) if v}
        cal = calibrate.calibrate(
            args.model, grid, max_seconds=args.max_seconds, seed=args.seed, scope=args.scope, **engine_kwargs
        )
    calibrate.write(cal, args.out)
    m, r = cal["step_time_model"], cal["fit"]
    curve = m.get("token_curve") or [[1, m["overhead_s"] + m["per_token_s"]]]
    print(
        f"wrote {args.out}: {cal['device']}, step of 1 token {curve[0][1] * 1e3:.3f} ms, "
        f"{m['per_sampled_s'] * 1e6:.3f} us/sampled row, {m['per_context_token_s'] * 1e9:.3f} ns/context token; "
        f"{r['num_samples']} steps, mean |rel err| {r['mean_abs_rel_error']:.1%}"
    )
    return 0

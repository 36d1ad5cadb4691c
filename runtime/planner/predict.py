"""Glue from a capacity plan (runtime/capacity via `kvserve plan`) and a calibration file to a simulated
prediction: one code path for the CLI (and, later, the operator)."""

from __future__ import annotations

import json

from kvserve.runtime.planner.simulator import EngineShape, Workload, simulate
from kvserve.runtime.planner.step_time import StepTimeModel

# 2: the token curve, sampled-row and attention-pair terms (step_time.py); version-1 files (three linear
# coefficients) still load as the linear model they were fitted as.
CALIBRATION_VERSION = 2


def load_calibration(path: str) -> dict:
    """A `kvserve calibrate` JSON file: {"version": 2, "step_time_model": {...}, "device": ..., ...}."""
    try:
        with open(path) as f:
            data = json.load(f)
        StepTimeModel.from_dict(data["step_time_model"])
    except OSError as e:
        raise ValueError(f"--calibration: cannot read {path}: {e.strerror}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--calibration: {path} is not a calibration file ({e})") from None
    return data


def predict(plan: dict, settings: dict, calibration: dict, workload: Workload) -> dict:
    """Simulate one replica with the plan's KV pool and the resolved engine settings."""
    shape = EngineShape(
        num_blocks=int(plan["num_blocks_per_gpu"]),
        block_size=int(plan["block_size"]),
        max_num_seqs=int(settings["max_num_seqs"]),
        max_num_batched_tokens=int(settings["max_num_batched_tokens"]),
        max_model_len=int(settings["max_model_len"]),
        # A served calibration (`kvserve calibrate`'s default scope) measured the front-end's time per request.
        admission_s=float(calibration.get("admission_s", 0.0)),
    )
    result = simulate(workload, shape, StepTimeModel.from_dict(calibration["step_time_model"]))
    return {"calibration_device": calibration.get("device"), "workload": _workload_dict(workload), **result.to_dict()}


def _workload_dict(w: Workload) -> dict:
    return {
        "prompt_len": [w.prompt_len.lo, w.prompt_len.hi],
        "output_len": [w.output_len.lo, w.output_len.hi],
        "num_requests": len(w.trace) or w.num_requests,
        "request_rate": w.request_rate,
        "concurrency": w.concurrency,
        "prefix_len": w.prefix_len,
        "seed": w.seed,
    }

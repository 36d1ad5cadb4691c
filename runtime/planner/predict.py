"""Glue from a capacity plan (runtime/capacity via `kvserve plan`) and a calibration file to a simulated
prediction: one code path for the CLI (and, later, the operator)."""

from __future__ import annotations

import json
from typing import NamedTuple

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


class SpecDecoding(NamedTuple):
    """Speculative decoding as the planner takes it (simulator.EngineShape's two fields)."""

    num_speculative_tokens: int = 0
    acceptance_rate: float = 0.0

    @classmethod
    def parse(cls, num_speculative_tokens: int, acceptance_rate: float | None) -> SpecDecoding:
        """From `kvserve plan`'s flags; raises ValueError naming the flag."""
        if num_speculative_tokens < 0:
            raise ValueError(f"--num-speculative-tokens: must be >= 0, got {num_speculative_tokens}")
        if acceptance_rate is None:
            if num_speculative_tokens:
                raise ValueError("--num-speculative-tokens needs --spec-acceptance-rate (the drafts' acceptance)")
            return cls()
        if not num_speculative_tokens:
            raise ValueError("--spec-acceptance-rate: give --num-speculative-tokens too")
        if not 0.0 <= acceptance_rate <= 1.0:
            raise ValueError(f"--spec-acceptance-rate: must be in [0, 1], got {acceptance_rate}")
        return cls(num_speculative_tokens, acceptance_rate)


def predict(
    plan: dict, settings: dict, calibration: dict, workload: Workload, spec: SpecDecoding = SpecDecoding()
) -> dict:
    """Simulate one replica with the plan's KV pool and the resolved engine settings."""
    shape = EngineShape(
        num_blocks=int(plan["num_blocks_per_gpu"]),
        block_size=int(plan["block_size"]),
        max_num_seqs=int(settings["max_num_seqs"]),
        max_num_batched_tokens=int(settings["max_num_batched_tokens"]),
        max_model_len=int(settings["max_model_len"]),
        # A served calibration (`kvserve calibrate`'s default scope) measured the front-end's time per request.
        admission_s=float(calibration.get("admission_s", 0.0)),
        num_speculative_tokens=spec.num_speculative_tokens,
        spec_acceptance_rate=spec.acceptance_rate,
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

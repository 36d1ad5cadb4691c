"""A per-step log for calibration from a running engine: `KVSERVE_STEP_LOG=/path/steps.jsonl kvserve serve ...`
makes the engine core append one JSON line per step with what the step computed and how long it took,
{"num_tokens", "context_tokens", "num_sampled", "attention_pairs", "seconds"} (runtime/planner/step_time.py's
StepWork plus the wall seconds of EngineCore.step). `kvserve calibrate` fits the same model on a profile of an
in-process engine; a step log is the served core's own steps, under its real neighbours (the API server, the
clients), which is what the planner's served predictions need (docs/planner.md). Off unless the variable is set.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from kvserve.runtime.planner.step_time import StepSample, step_work

ENV = "KVSERVE_STEP_LOG"


class StepLog:
    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - held for the engine's life; line-buffered: read live

    @classmethod
    def from_env(cls) -> StepLog | None:
        path = os.environ.get(ENV)
        return cls(path) if path else None

    def record(self, scheduled, seconds: float) -> None:
        if scheduled:
            w = step_work(scheduled)
            # end_s (monotonic): consecutive lines give the core loop's time between steps (outputs sent,
            # requests received), which the served replica spends per step too (planner/served_steps.py).
            end_s = time.monotonic()
            self._file.write(json.dumps({**w._asdict(), "seconds": seconds, "end_s": end_s}) + "\n")


@contextlib.contextmanager
def children_log_to(path: str):
    """Processes started inside the block (a `kvserve serve` a benchmark launches) write their step log to `path`
    (they inherit the environment); the variable is put back as it was on the way out."""
    saved = os.environ.get(ENV)
    os.environ[ENV] = path
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved


def read_lines(path: str) -> list[dict]:
    """The lines of a step log as dicts (a partly written last line is skipped)."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def sample(d: dict) -> StepSample:
    """One line's StepSample (its own seconds, without the loop's time after it)."""
    return StepSample(d["num_tokens"], d["context_tokens"], d["seconds"], d["num_sampled"], d["attention_pairs"])


def read(path: str) -> list[StepSample]:
    """The samples of a step log (a partly written last line is skipped)."""
    return [sample(d) for d in read_lines(path)]

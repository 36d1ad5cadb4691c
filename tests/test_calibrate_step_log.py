"""`kvserve calibrate --from-step-log`: a served replica's step log (KVSERVE_STEP_LOG, written by the engine core's
StepLog) fitted into a calibration file `kvserve plan --calibration` loads, in place of an offline profile."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from kvserve.cli.main import main
from kvserve.runtime.engine.step_log import StepLog
from kvserve.runtime.planner.predict import load_calibration
from kvserve.runtime.planner.step_time import StepTimeModel, step_work

# What the "served replica" runs: a memory-bound floor, then compute-bound growth; costs per sampled row and
# per context token.
TRUE = StepTimeModel(0.0, 0.0, 2e-6, 1e-4, 0.0, ((1, 0.030), (64, 0.032), (512, 0.120), (2048, 0.450)))


def _scheduled(rng: random.Random) -> list[SimpleNamespace]:
    """One step's scheduled requests, as SchedulerOutput.scheduled holds them: decodes and a prefill chunk."""
    decodes = [
        SimpleNamespace(token_ids=[1], start_position=rng.randint(10, 900), sample=True)
        for _ in range(rng.randint(0, 48))
    ]
    if rng.random() < 0.5 or not decodes:
        n = rng.choice([16, 64, 200, 512, 1024, 2000])
        decodes.append(SimpleNamespace(token_ids=[1] * n, start_position=0, sample=True))
    return decodes


def _write_log(path: str, steps: int = 300) -> None:
    rng = random.Random(0)
    log = StepLog(path)
    for _ in range(steps):
        scheduled = _scheduled(rng)
        log.record(scheduled, TRUE.step_seconds(*step_work(scheduled)) * rng.uniform(0.98, 1.02))


def test_a_served_step_log_becomes_a_calibration_that_predicts_its_steps(tmp_path, capsys):
    log, out = str(tmp_path / "steps.jsonl"), str(tmp_path / "cal.json")
    _write_log(log)
    assert main(["calibrate", "--from-step-log", log, "--out", out]) == 0
    assert "fitted on 300 served steps" in capsys.readouterr().out
    cal = load_calibration(out)  # what kvserve plan --calibration reads
    assert (cal["device"], cal["scope"], cal["step_log"]) == ("served engine core", "served", log)
    fitted = StepTimeModel.from_dict(cal["step_time_model"])
    rng = random.Random(1)
    for _ in range(50):  # steps the fit did not see
        work = step_work(_scheduled(rng))
        assert fitted.step_seconds(*work) == pytest.approx(TRUE.step_seconds(*work), rel=0.08)


def test_an_unreadable_or_short_log_is_an_error_naming_the_flag(tmp_path, capsys):
    missing = str(tmp_path / "nope.jsonl")
    assert main(["calibrate", "--from-step-log", missing]) != 0
    assert "--from-step-log: cannot read" in capsys.readouterr().err
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"num_tokens": 1, "context_tokens": 1, "seconds": 0.1}) + "\n")
    assert main(["calibrate", "--from-step-log", str(short)]) != 0
    assert "--from-step-log" in capsys.readouterr().err

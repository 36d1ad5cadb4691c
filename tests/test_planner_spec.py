"""Speculative decoding in the simulator (issue 44 scope 7): drafts scheduled through the real scheduler, each
accepted with the given rate; the step-time model pays for the verified tokens."""

from __future__ import annotations

import random

import pytest

from kvserve.runtime.planner.simulator import EngineShape, LengthSpec, Workload, accepted_drafts, simulate
from kvserve.runtime.planner.step_time import StepTimeModel

STEP = StepTimeModel(0.010, 1e-4, 0.0)  # 10 ms + 0.1 ms per computed token
WORK = Workload(LengthSpec(32, 32), LengthSpec(33, 33), num_requests=8, concurrency=2)


def _run(k: int, rate: float):
    shape = EngineShape(num_blocks=256, num_speculative_tokens=k, spec_acceptance_rate=rate)
    return simulate(WORK, shape, STEP, record_steps=True)


def test_accepted_drafts_stop_at_the_first_rejection():
    rng = random.Random(0)
    assert accepted_drafts(rng, 4, 1.0) == 4 and accepted_drafts(rng, 4, 0.0) == 0
    draws = [accepted_drafts(rng, 3, 0.5) for _ in range(20000)]
    assert sum(draws) / len(draws) == pytest.approx(0.5 + 0.25 + 0.125, rel=0.03)


def test_drafts_cut_the_steps_by_what_is_accepted_and_cost_their_verification():
    plain, none, every = _run(0, 0.0), _run(3, 0.0), _run(3, 1.0)
    # 8 requests of 33 tokens, two at a time: every output token is produced, whatever the drafts did.
    for r in (plain, none, every):
        assert r.output_tokens_per_s * r.duration_s == pytest.approx(8 * 33)
    # Nothing accepted: the same steps as without drafts, each verifying 3 more tokens per request.
    assert none.num_steps == plain.num_steps and sum(none.step_tokens) > sum(plain.step_tokens)
    assert none.tpot_s["p50"] > plain.tpot_s["p50"]
    # Everything accepted: 4 tokens a step per request (the last steps fewer, within max_tokens).
    assert every.num_steps < plain.num_steps / 3 and every.tpot_s["p50"] < plain.tpot_s["p50"] / 2
    half = _run(3, 0.5)
    assert every.num_steps < half.num_steps < none.num_steps


def test_bad_spec_settings_name_the_field():
    with pytest.raises(ValueError, match="spec_acceptance_rate"):
        EngineShape(num_blocks=8, num_speculative_tokens=2, spec_acceptance_rate=1.5)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineShape(num_blocks=8, num_speculative_tokens=-1)


def test_plan_takes_the_drafts_and_their_acceptance(tmp_path, capsys):
    import json

    from kvserve.cli.main import main

    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"version": 2, "device": "x", "engine_device": "cpu", "step_time_model": STEP.to_dict()}))
    base = ["plan", "--model-config", "examples/models/stories260K", "--calibration", str(cal), "--json"]
    base += ["--concurrency", "2", "--num-requests", "8", "--prompt-len", "32", "--output-len", "33"]

    def tpot(*extra: str) -> float:
        assert main([*base, *extra]) == 0
        return json.loads(capsys.readouterr().out)["prediction"]["tpot_s"]["p50"]

    plain = tpot()
    assert tpot("--num-speculative-tokens", "3", "--spec-acceptance-rate", "0.9") < plain / 2
    assert main([*base, "--num-speculative-tokens", "3"]) == 2
    assert "--num-speculative-tokens needs --spec-acceptance-rate" in capsys.readouterr().out
    assert main([*base, "--num-speculative-tokens", "3", "--spec-acceptance-rate", "2"]) == 2
    assert "--spec-acceptance-rate: must be in [0, 1]" in capsys.readouterr().out

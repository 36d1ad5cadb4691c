"""The planner accuracy grid (issue 44 scope 1): its configurations, its request builders, its MAPE, and the
served-step folding its calibration uses (runtime/planner/served_steps.py). Pure parts, no server."""

from __future__ import annotations

import json
import random

import pytest

from kvserve.runtime.bench import planner_accuracy as pa
from kvserve.runtime.bench import planner_grid as grid
from kvserve.runtime.bench.planner_grid_configs import CONFIGS, MODELS, QUICK, model_config, multi_turn_requests, select
from kvserve.runtime.planner.served_steps import gaps, with_loop_gaps
from kvserve.runtime.planner.step_time import StepTimeModel

# A served replica's steps: a floor, then compute-bound growth; costs per sampled row and per context token.
TRUE = StepTimeModel(0.0, 0.0, 2e-6, 1e-4, 0.0, ((1, 0.010), (64, 0.012), (512, 0.060), (2048, 0.200)))
MODEL = StepTimeModel(0.004, 2e-5, 1e-6, 5e-8, 0.0, ())  # a plain linear step: 4 ms + 20 us/token + ...


def test_the_grid_covers_what_the_issue_asks_for():
    assert len(CONFIGS) >= 24 and len({c.name for c in CONFIGS}) == len(CONFIGS)
    archs = {m.architecture for m in MODELS}
    assert None in archs  # the real default model
    assert {"Qwen3MoeForCausalLM", "Gemma2ForCausalLM"} <= archs
    assert model_config(next(m for m in MODELS if m.architecture == "Gemma2ForCausalLM"))["sliding_window"] > 0
    assert {m.tensor_parallel_size for m in MODELS} == {1, 2}
    assert model_config(next(m for m in MODELS if m.tensor_parallel_size == 2))["hidden_size"] > 0  # its base's
    cases = [c.case for c in CONFIGS]
    assert len({c.load for c in cases if c.load is not None}) >= 3
    assert any(c.prompt_len >= 600 for c in cases) and any(c.prefix_len for c in cases)
    assert any(c.turns > 1 for c in CONFIGS) and any(c.concurrency and c.concurrency >= 16 for c in cases)
    assert {c.model for c in CONFIGS} == {m.name for m in MODELS}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_every_configuration_fits_the_served_engine(config):
    requests = grid.requests_for(config, random.Random(0), 8192, 5.0 if config.case.load else None)
    assert requests and all(len(p) + o <= pa.ENGINE["max_model_len"] for _, p, o in requests)
    assert all(min(p) >= 3 for _, p, _ in requests)  # no special ids (0-2: unk, bos, eos)


def test_select_quick_names_models_and_unknown_names():
    assert [c.name for c in select(None, quick=True)] == list(QUICK)
    assert select(None) == CONFIGS
    tp2 = select("llama-25m-tp2")
    assert tp2 and all(c.model == "llama-25m-tp2" for c in tp2)
    assert [c.name for c in select("smollm2-135m/closed-1, llama-25m/closed-1")] == [
        "smollm2-135m/closed-1",
        "llama-25m/closed-1",
    ]
    with pytest.raises(ValueError, match="--configs: no configuration 'nope'"):
        select("nope")


def test_multi_turn_prompts_extend_their_conversation_and_come_in_turn_order():
    config = next(c for c in CONFIGS if c.turns > 1)
    convs, turns = config.case.concurrency, config.turns
    requests = multi_turn_requests(config, random.Random(0), 1000)
    assert len(requests) == convs * turns == config.case.num_requests
    for k in range(convs):
        prompts = [requests[t * convs + k][1] for t in range(turns)]
        for earlier, later in zip(prompts, prompts[1:]):
            assert later[: len(earlier)] == earlier and len(later) > len(earlier)
    firsts = [requests[k][1] for k in range(convs)]
    assert len({tuple(p) for p in firsts}) == convs  # conversations share nothing


def test_predicting_a_multi_turn_config_replays_its_prefix_hits():
    """The simulator gets the measured prompts (Workload.prompts): later turns hit their conversation's cached
    prompt, so they compute fewer tokens and their TTFT is shorter than a prompt of the same length without."""
    config = next(c for c in CONFIGS if c.turns > 1)
    requests = multi_turn_requests(config, random.Random(0), 1000)
    hits = grid.predict(config, requests, MODEL, 0.0)
    fresh = [(a, [3 + (i * 7 + j) % 990 for j in range(len(p))], o) for i, (a, p, o) in enumerate(requests)]
    misses = grid.predict(config, fresh, MODEL, 0.0)
    assert hits["ttft_p90"] < misses["ttft_p90"]
    for p in (hits, misses):
        assert set(grid.METRICS) <= set(p) and p["e2e_p50"] > p["ttft_p50"] > 0 and p["tpot_p90"] >= p["tpot_p50"]


def test_errors_and_mape():
    measured = dict.fromkeys(grid.METRICS, 2.0) | {"tpot_p90": 0.0}
    predicted = dict.fromkeys(grid.METRICS, 2.5) | {"throughput": 1.0}
    e = grid.errors(predicted, measured)
    assert e["e2e_p50"] == pytest.approx(0.25) and e["throughput"] == pytest.approx(-0.5) and e["tpot_p90"] is None
    rows = [{"error": e}, {"error": dict.fromkeys(grid.METRICS, -0.05)}]
    m = grid.mape(rows)
    assert m["throughput"] == pytest.approx(0.275) and m["tpot_p90"] == pytest.approx(0.05)
    s = grid.summarize([1.0, 2.0, 3.0], [2.0, 4.0], [0.1], 50.0)
    assert (s["ttft_p50"], s["e2e_p90"], s["tpot_p50"], s["throughput"]) == (2.0, pytest.approx(3.8), 0.1, 50.0)
    assert "MAPE over 2 configurations" in grid.overall(rows)


def _line(tokens: int, seconds: float, end_s: float | None) -> dict:
    d = {"num_tokens": tokens, "context_tokens": tokens, "num_sampled": 1, "attention_pairs": 0, "seconds": seconds}
    return d if end_s is None else {**d, "end_s": end_s}


def test_loop_gaps_fold_into_the_step_before_them_when_the_core_stayed_busy():
    # Steps of 10 ms ending at 0.010, 0.022 (a 2 ms gap), 0.532 (a 500 ms idle wait), 0.543 (1 ms).
    lines = [_line(1, 0.010, 0.010), _line(2, 0.010, 0.022), _line(3, 0.010, 0.532), _line(4, 0.010, 0.543)]
    assert gaps(lines) == [pytest.approx(0.002), pytest.approx(0.5), pytest.approx(0.001), None]
    seconds = [s.seconds for s in with_loop_gaps(lines)]
    assert seconds == [pytest.approx(0.012), 0.010, pytest.approx(0.011), 0.010]  # the idle wait is not work
    busy = [s.seconds for s in with_loop_gaps(lines, busy_to_end=True)]
    assert busy == [pytest.approx(0.012), pytest.approx(0.510), pytest.approx(0.011), 0.010]
    old = [_line(1, 0.010, None), _line(2, 0.010, None)]  # a log written before end_s: the steps alone
    assert [s.seconds for s in with_loop_gaps(old)] == [0.010, 0.010] and gaps([]) == []


def test_a_step_log_calibration_names_its_device_so_plan_plans_that_cpu_server(tmp_path, capsys):
    """Scope 6 through the served path: `kvserve calibrate --from-step-log` on a CPU replica's log, then `kvserve
    plan --model-config DIR --calibration cal.json --concurrency N` plans that CPU server without --gpu."""
    from kvserve.cli.main import main

    log, cal = tmp_path / "steps.jsonl", tmp_path / "cal.json"
    rng, t = random.Random(0), 0.0
    with open(log, "w") as f:
        for _ in range(200):
            tokens = rng.choice([1, 4, 16, 64, 200, 512, 1024])
            sampled, context = rng.randint(1, min(tokens, 48)), rng.randint(tokens, tokens + 900)
            step = TRUE.step_seconds(tokens, context, sampled)
            t += 0.002 + step  # a 2 ms loop gap before each step
            line = {**_line(tokens, step, t), "context_tokens": context, "num_sampled": sampled}
            f.write(json.dumps(line) + "\n")
    assert main(["calibrate", "--from-step-log", str(log), "--device", "cpu", "--out", str(cal)]) == 0
    data = json.loads(cal.read_text())
    assert data["engine_device"] == "cpu"
    fitted = StepTimeModel.from_dict(data["step_time_model"])
    assert fitted.step_seconds(64, 164, 32) == pytest.approx(
        TRUE.step_seconds(64, 164, 32) + 0.002, rel=0.05
    )  # the step and its gap
    capsys.readouterr()
    args = ["plan", "--model-config", "examples/models/stories260K", "--calibration", str(cal), "--json"]
    rc = main([*args, "--concurrency", "4", "--num-requests", "16", "--prompt-len", "32", "--output-len", "4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert json.loads(out)["device"] == "cpu"


def test_the_cli_lists_the_grid_and_names_a_bad_config(capsys):
    from kvserve.cli.main import main

    assert main(["bench", "planner-grid", "--list", "--configs", "llama-25m-tp2"]) == 0
    assert capsys.readouterr().out.split() == [c.name for c in CONFIGS if c.model == "llama-25m-tp2"]
    assert main(["bench", "planner-grid", "--configs", "nope"]) == 2
    assert "--configs: no configuration 'nope'" in capsys.readouterr().err

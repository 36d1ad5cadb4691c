"""The served paths of issue 44 end to end on a tiny model: one grid configuration measured through `kvserve serve`
and predicted from the server's own calibration (planner_grid.run_model), and `kvserve calibrate`'s default
served scope, whose file `kvserve plan` then uses for that CPU server without --gpu."""

from __future__ import annotations

import json

from kvserve.runtime.bench import planner_grid as grid
from kvserve.runtime.bench.planner_accuracy import Case
from kvserve.runtime.bench.planner_grid_configs import GridConfig, ServedModel


def test_a_grid_configuration_is_measured_and_predicted_through_its_server(model_factory, monkeypatch):
    from kvserve.runtime.bench.calibrate import Grid

    tiny = model_factory("llama_gqa")[0]
    small = Grid(prompt_lens=(16, 64), batch_sizes=(1, 4, 8), decode_steps=4, warm_each_point=False)
    monkeypatch.setattr(grid, "calibration_grid", lambda: small)  # the grid's own: 9 bursts, the suite's time
    config = GridConfig("tiny", Case("closed-4", 24, 4, 8, concurrency=4, ramp_s=0.05, output_len_max=6))
    lines: list[str] = []
    result = grid.run_model(ServedModel("tiny", "LlamaForCausalLM"), [config], tiny, 0, lines.append)
    cal, (row,) = result["calibration"], result["rows"]
    assert cal["fit"]["num_samples"] >= 8 and cal["loop_gaps"] is True
    assert row["config"] == "tiny/closed-4" and row["num_requests"] == 8
    assert all(row["measured"][k] > 0 for k in grid.METRICS) and all(row["predicted"][k] > 0 for k in grid.METRICS)
    assert row["measured"]["num_steps"] > 0 and row["step_drift"] > 0
    assert set(row["error"]) == set(grid.METRICS) == set(row["error_drift_removed"]) == set(row["error_steps_alone"])
    assert cal["step_time_model_steps_alone"] != cal["step_time_model"]  # the loop gaps changed the fit
    assert any(line.startswith("tiny/closed-4") for line in lines)


def test_calibrate_serves_the_model_by_default_and_plan_uses_it_for_that_cpu_server(model_factory, tmp_path, capsys):
    from kvserve.cli.main import main

    tiny = model_factory("llama_gqa")[0]
    out = str(tmp_path / "cal.json")
    rc = main(
        ["calibrate", tiny, "--prompt-lens", "16,48", "--batch-sizes", "1,4", "--decode-steps", "4", "--out", out]
    )
    assert rc == 0
    cal = json.load(open(out))
    assert (cal["scope"], cal["engine_device"]) == ("served", "cpu") and cal["fit"]["num_samples"] >= 8
    assert cal["admission_s"] >= 0 and cal["model"]["dir"] == tiny
    capsys.readouterr()
    args = ["plan", "--model-config", tiny, "--calibration", out, "--concurrency", "4", "--num-requests", "8"]
    assert main([*args, "--prompt-len", "16", "--output-len", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["device"] == "cpu"

"""`kvserve plan --calibration ...`: the simulated prediction on top of the capacity plan."""

import json

from kvserve.cli import main as cli_main

CAL = {
    "version": 1,
    "device": "test",
    "step_time_model": {"overhead_s": 0.005, "per_token_s": 2e-5, "per_context_token_s": 1e-7},
}


def _plan(capsys, *extra):
    rc = cli_main.main(["plan", "--model", "llama-3-8b", "--gpu", "a100-80gb", *extra])
    return rc, capsys.readouterr().out


def test_plan_prediction_json(tmp_path, capsys):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(CAL))
    rc, out = _plan(
        capsys,
        "--calibration",
        str(cal),
        "--concurrency",
        "8",
        "--num-requests",
        "40",
        "--prompt-len",
        "128:256",
        "--output-len",
        "16",
        "--json",
    )
    assert rc == 0
    p = json.loads(out)["prediction"]
    assert p["num_requests"] == 40 and p["calibration_device"] == "test"
    assert 0 < p["ttft_s"]["p50"] <= p["ttft_s"]["p99"] and p["tpot_s"]["p50"] > 0
    assert p["workload"]["prompt_len"] == [128, 256]


def test_plan_prediction_bad_input(tmp_path, capsys):
    rc, out = _plan(capsys, "--calibration", str(tmp_path / "missing.json"), "--concurrency", "2")
    assert rc == 2 and "--calibration: cannot read" in out
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(CAL))
    rc, out = _plan(capsys, "--calibration", str(cal))
    assert rc == 2 and "needs a workload" in out
    rc, out = _plan(capsys, "--calibration", str(cal), "--request-rate", "1", "--prompt-len", "x")
    assert rc == 2 and "--prompt-len" in out

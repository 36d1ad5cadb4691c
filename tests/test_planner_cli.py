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


def _search(capsys, *extra):
    rc = cli_main.main(["plan", "--model", "llama-3-8b", "--slo-ttft-p90", "1", "--slo-tpot-p99", "0.05", *extra])
    return rc, capsys.readouterr().out


def test_slo_search_prints_the_cheapest_fleet_and_hpa_bounds(tmp_path, capsys):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(CAL))
    flags = ["--request-rate", "30", "--min-request-rate", "3", "--prompt-len", "256", "--output-len", "32"]
    rc, out = _search(capsys, *flags, "--gpus", "l4,h100", "--gpu-price", "h100=1.5", "--json")
    assert rc == 0
    f = json.loads(out)["fleet"]
    opts = [o for o in f["options"] if o["feasible"]]
    assert f["choice"] == opts[0] and {o["gpu"] for o in f["options"]} == {"l4", "h100-80gb"}
    assert [o["usd_per_hour"] for o in opts] == sorted(o["usd_per_hour"] for o in opts)
    for o in opts:
        hpa = o["hpa"]
        assert hpa["max_replicas"] == o["replicas"] >= hpa["min_replicas"] >= 1
        assert o["replicas"] * o["replica_requests_per_s"] >= 30 > (o["replicas"] - 1) * o["replica_requests_per_s"]
        assert o["ttft_p90_s_at_capacity"] <= 1 and o["tpot_p99_s_at_capacity"] <= 0.05
        price = 1.5 if o["gpu"] == "h100-80gb" else 0.805
        assert o["usd_per_hour"] == o["gpus"] * price
    assert "roofline" in f["choice"]["step_time_source"]
    # A calibration for --gpu at its TP replaces the roofline there (the anchor's own deployment).
    rc, out = _search(capsys, *flags, "--gpu", "h100", "--gpus", "h100", "--calibration", str(cal), "--json")
    tp1 = next(o for o in json.loads(out)["fleet"]["options"] if o["tensor_parallel_size"] == 1)
    assert tp1["step_time_source"] == "calibration (test)"
    # The engine settings are searched per GPU x TP, each option saying what it tried (the resolved ones first).
    assert f["searched_engine_settings"] == ["max_num_batched_tokens", "max_num_seqs"]
    for o in opts:
        first = o["engine_settings_tried"][0]
        assert (first["max_num_seqs"], first["max_num_batched_tokens"]) == (256, 2048)
        assert o["max_num_batched_tokens"] >= o["max_num_seqs"]
    # A flag the user gives is kept: not searched. The table names the choice, its flags and the HPA bounds.
    rc, out = _search(capsys, *flags, "--gpus", "h100", "--max-num-seqs", "64")
    assert rc == 0 and "choice: " in out and "HPA minReplicas" in out and "--max-num-seqs 64 " in out
    assert "searched: max_num_batched_tokens;" in out


def test_slo_search_errors_name_the_flag(capsys):
    rc, out = _search(capsys, "--gpus", "h100")
    assert rc == 2 and "needs --request-rate" in out
    rc, out = _search(capsys, "--request-rate", "1", "--gpus", "nope")
    assert rc == 2 and "--gpus: 'nope'" in out
    rc, out = _search(capsys, "--request-rate", "1", "--gpus", "h100", "--gpu-price", "h100=x")
    assert rc == 2 and "--gpu-price" in out
    rc, out = _search(capsys, "--request-rate", "1", "--min-request-rate", "2", "--gpus", "h100")
    assert rc == 2 and "--min-request-rate must be in [0, --request-rate]" in out
    # Unreachable: a 1 ms TTFT. No choice, exit 1, every option says why.
    rc, out = (
        cli_main.main(
            [
                "plan",
                "--model",
                "llama-3-8b",
                "--slo-ttft-p90",
                "0.001",
                "--slo-tpot-p99",
                "0.05",
                "--request-rate",
                "1",
                "--gpus",
                "h100",
                "--json",
            ]
        ),
        capsys.readouterr().out,
    )
    f = json.loads(out)["fleet"]
    assert rc == 1 and f["choice"] is None and all("TTFT p90" in o["reason"] for o in f["options"])


def _cpu_plan(tmp_path, capsys, engine_device, *extra):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({**CAL, "version": 2, "device": "Intel Xeon (test)", "engine_device": engine_device}))
    rc = cli_main.main(
        ["plan", "--model-config", "examples/models/stories260K", "--calibration", str(cal), "--concurrency", "4"]
        + ["--num-requests", "24", "--prompt-len", "64", "--output-len", "8", *extra]
    )
    return rc, capsys.readouterr().out


def test_a_cpu_calibration_plans_its_cpu_server(tmp_path, capsys):
    """No --gpu: the CPU server the calibration measured, its KV pool as `kvserve serve` sizes it on a CPU (the
    1 GiB default, or --kv-cache-bytes), in blocks of the model's own KV layout."""
    from kvserve.runtime import capacity
    from kvserve.runtime.config import DEFAULT_CPU_KV_CACHE_BYTES

    rc, out = _cpu_plan(tmp_path, capsys, "cpu", "--json")
    assert rc == 0, out
    plan = json.loads(out)
    # stories260K: 5 layers x 4 KV heads x head_dim 8, K and V in fp32, 16-token blocks
    layout = capacity.kv_layout(
        capacity.shape_from_hf_config(json.load(open("examples/models/stories260K/config.json"))),
        "float32",
        "auto",
        16,
        1,
    )
    assert layout.bytes_per_block == 5 * 2 * 4 * 8 * 4 * 16
    assert plan["device"] == "cpu" and plan["kv_cache_bytes_per_gpu"] == DEFAULT_CPU_KV_CACHE_BYTES
    assert plan["num_blocks_per_gpu"] == DEFAULT_CPU_KV_CACHE_BYTES // layout.bytes_per_block
    assert plan["prediction"]["num_requests"] == 24 and plan["prediction"]["calibration_device"] == "Intel Xeon (test)"
    rc, out = _cpu_plan(tmp_path, capsys, "cpu", "--kv-cache-bytes", "1MiB", "--json")
    assert rc == 0 and json.loads(out)["num_blocks_per_gpu"] == (1 << 20) // layout.bytes_per_block
    rc, out = _cpu_plan(tmp_path, capsys, "cpu")  # the table names the device and the budget's source
    assert rc == 0 and "CPU server" in out and "kvserve serve's CPU default" in out and "TTFT" in out


def test_a_gpu_calibration_still_needs_its_gpu(tmp_path, capsys):
    rc, out = _cpu_plan(tmp_path, capsys, "cuda:0")
    assert rc == 2 and "measured on Intel Xeon (test): give --gpu" in out
    rc = cli_main.main(["plan", "--model", "llama-3-8b", "--gpu", "a100-80gb", "--kv-cache-bytes", "1GiB"])
    assert rc == 2 and "--kv-cache-bytes plans a CPU server" in capsys.readouterr().out


def test_disaggregation_auto_shows_both_answers_and_decides(capsys):
    """--disaggregation auto: every GPU x TP also as prefill + decode pools (runtime/planner/disagg.py); the JSON
    carries the aggregated choice, the cheapest P/D fleet and the decision; a link of 0 GB/s is refused by name."""
    flags = ["--request-rate", "20", "--prompt-len", "4096", "--output-len", "64", "--gpus", "h100"]
    flags += ["--max-num-seqs", "64", "--max-num-batched-tokens", "2048", "--gpus-per-node", "2"]
    rc = cli_main.main(["plan", "--model", "llama-3-8b", "--slo-ttft-p90", "2", "--slo-tpot-p99", "0.03", *flags,
                        "--disaggregation", "auto", "--json"])  # fmt: skip
    f = json.loads(capsys.readouterr().out)["fleet"]
    d = f["disaggregation"]
    assert rc == 0 and d["mode"] == "auto" and d["kv_transfer_gb_s"] == 25.0
    assert d["aggregated_usd_per_hour"] == f["choice"]["usd_per_hour"]
    best = d["disaggregated_choice"]
    assert best is not None and best["prefill_decode_ratio"] == f"{best['prefill_replicas']}:{best['decode_replicas']}"
    assert best["ttft_p90_s"] <= 2 and best["tpot_p99_s"] <= 0.03
    assert best["kv_transfer_s"] == 4096 * 131_072 / 25e9  # Llama-3-8B's KV bytes per token over 25 GB/s
    cheaper = "disaggregated" if best["usd_per_hour"] < f["choice"]["usd_per_hour"] else "aggregated"
    assert d["decision"] == cheaper
    # The table: the aggregated choice, then the pools and the decision last.
    from kvserve.cli import plan_fleet

    table = plan_fleet.format_fleet(f).splitlines()
    assert table[-1] == f"decision: {cheaper}" and any(line.startswith("aggregated choice: ") for line in table)
    assert any(
        line.startswith(f"P/D: {best['prefill_replicas']} prefill + {best['decode_replicas']} decode") for line in table
    )
    rc = cli_main.main(["plan", "--model", "llama-3-8b", "--slo-ttft-p90", "2", "--slo-tpot-p99", "0.03", *flags,
                        "--disaggregation", "on", "--kv-transfer-gb-s", "0"])  # fmt: skip
    assert rc == 2 and "--kv-transfer-gb-s must be > 0" in capsys.readouterr().out

"""`kvserve bench peer` without vLLM (CI never installs it): the pure parts (ABBA order, identical-sequence
count, tables and ratio, the peer-missing exit), server start/stop bounds, and the kvserve side of the
offline mode end to end on a tiny random model in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kvserve.runtime.bench import cpu_pinning, peer, peer_tables, peer_venv, processes


def test_abba_order():
    assert peer_tables.abba_order("vllm", "kvserve") == ["vllm", "kvserve", "kvserve", "vllm"]
    assert peer_tables.abba_order("kvserve", "vllm", rounds=2) == ["kvserve", "vllm", "vllm", "kvserve"] * 2
    with pytest.raises(ValueError):
        peer_tables.abba_order("a", "b", rounds=0)


def test_identical_sequences_and_common_prefix():
    a = [[1, 2, 3], [4, 5, 6, 7], [8]]
    b = [[1, 2, 3], [4, 5, 9, 7], [9]]
    assert peer_tables.count_identical(a, b) == 1
    assert peer_tables.count_identical(a, a) == 3
    assert peer_tables.common_prefix_fraction(a, b) == pytest.approx((1 + 2 / 4 + 0) / 3)
    with pytest.raises(ValueError):
        peer_tables.count_identical(a, b[:2])


def test_cpu_lists():
    assert cpu_pinning.parse_cpus("0-1,3") == [0, 1, 3]
    assert cpu_pinning.parse_cpus("2") == [2]
    assert cpu_pinning.format_cpus([3, 0, 1, 5, 6, 7]) == "0-1,3,5-7"
    for bad in ("", "a", "3-1", "-1"):
        with pytest.raises(ValueError):
            cpu_pinning.parse_cpus(bad)
    assert cpu_pinning.default_cpus("offline", [0, 1]) == ([0, 1], [0, 1])
    assert cpu_pinning.default_cpus("served", [0, 1]) == ([1], [0])
    assert cpu_pinning.default_cpus("served", [0]) == ([0], [0])


def _settings(**kw):
    base = dict(
        dtype="bfloat16",
        max_num_seqs=128,
        max_num_batched_tokens=2048,
        block_size=128,
        max_model_len=480,
        kv_cache_gib=2,
        seed=0,
        cpus="0-1",
    )
    return peer.Settings(**(base | kw))


def test_engine_env_and_server_commands_match():
    s = _settings(cpus="1")
    env = peer.engine_env("vllm", s)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and "PYTHONPATH" not in env
    assert peer.engine_env("kvserve", s)["OMP_NUM_THREADS"] == "1"
    cmds = {e: peer.server_command(e, "python", "/m", 8000, s) for e in peer.ENGINES}
    assert cmds["vllm"][1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    for cmd in cmds.values():
        flags = dict(zip(cmd, cmd[1:]))
        assert flags["--host"] == "127.0.0.1"
        assert (
            flags["--max-num-seqs"],
            flags["--max-num-batched-tokens"],
            flags["--block-size"],
            flags["--max-model-len"],
            flags["--dtype"],
        ) == ("128", "2048", "128", "480", "bfloat16")
    assert dict(zip(cmds["kvserve"], cmds["kvserve"][1:]))["--kv-cache-bytes"] == str(2 * 2**30)


def _offline_report():
    runs = [
        dict(engine=e, seconds=s, tok_per_s=t, init_s=1.0, load_before=0.5)
        for e, s, t in (
            ("vllm", 9.0, 1000.0),
            ("kvserve", 18.0, 500.0),
            ("kvserve", 15.0, 600.0),
            ("vllm", 10.0, 900.0),
        )
    ]
    return {
        "mode": "offline",
        "model": "m",
        "engines": ["vllm", "kvserve"],
        "order": [r["engine"] for r in runs],
        "runs_per_engine": 2,
        "settings": vars(_settings()) | {"threads": 2},
        "workload": {"num_requests": 96, "prompt_tokens": 16000, "output_tokens": 9000, "seed": 0},
        "runs": runs,
        "summary": {
            "vllm": {
                "version": "0.32.0",
                "tok_per_s_runs": [1000.0, 900.0],
                "best_tok_per_s": 1000.0,
                "self_identical": 96,
            },
            "kvserve": {
                "version": "0.1.0",
                "tok_per_s_runs": [500.0, 600.0],
                "best_tok_per_s": 600.0,
                "self_identical": 96,
            },
        },
        "greedy": {"identical": 95, "total": 96, "common_prefix_fraction": 0.99},
        "ratio": 0.6,
    }


def test_offline_table():
    text = peer_tables.format_offline_table(_offline_report())
    assert "kvserve / vLLM (best output tok/s): 0.60x" in text
    assert "greedy sequences identical between the engines: 95/96" in text
    assert "vllm kvserve kvserve vllm (ABBA); best of 2" in text
    assert "block_size 128" in text and "cores 0-1 (2 threads)" in text


def test_served_table():
    def metrics(tok, itl):
        return {
            "output_throughput": tok,
            "p50_ttft_ms": 3000.0,
            "p90_ttft_ms": 5000.0,
            "p99_ttft_ms": 6000.0,
            "p50_itl_ms": itl,
            "p90_itl_ms": itl * 2,
            "p99_itl_ms": itl * 3,
            "failed": 0,
        }

    runs = [
        {"engine": "vllm", "metrics": metrics(800.0, 90.0), "load_before": 0.1},
        {"engine": "kvserve", "metrics": metrics(400.0, 200.0), "load_before": 0.1},
    ]
    report = _offline_report() | {
        "mode": "served",
        "runs": runs,
        "concurrency": 128,
        "client_cpus": "0",
        "summary": {"vllm": {"best": runs[0]["metrics"]}, "kvserve": {"best": runs[1]["metrics"]}},
        "ratio": 0.5,
    }
    text = peer_tables.format_served_table(report)
    assert "128 concurrent streams" in text and "client on cores 0" in text
    assert "kvserve / vLLM (best output tok/s): 0.50x" in text
    assert "median ITL: kvserve 200.0 ms, vLLM 90.0 ms" in text


def test_peer_missing_exit_code(tmp_path, capsys):
    from kvserve.cli.main import main

    assert main(["bench", "peer", "--peer-venv", str(tmp_path / "absent")]) == peer_venv.PEER_MISSING_EXIT
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "tools/make_peer_venv.sh" in out[0] and "no bin/python" in out[0]
    # a python that cannot find vllm (this interpreter outside any venv: a bare copy of its binary's link)
    (tmp_path / "novllm" / "bin").mkdir(parents=True)
    os.symlink(sys.executable, tmp_path / "novllm" / "bin" / "python")
    assert main(["bench", "peer", "--peer-venv", str(tmp_path / "novllm")]) == peer_venv.PEER_MISSING_EXIT
    assert "vllm is not installed there" in capsys.readouterr().out


def test_server_start_failures_are_bounded_and_leave_nothing(tmp_path):
    # exits before it is ready: the error carries the log tail
    crash = processes.Server(
        "x",
        [sys.executable, "-c", "print('boom'); raise SystemExit(3)"],
        dict(os.environ),
        sorted(os.sched_getaffinity(0)),
        processes.free_port(),
        str(tmp_path / "a.log"),
        30,
    )
    with pytest.raises(RuntimeError, match="(?s)exited with 3.*boom"):
        crash.__enter__()
    # never becomes ready (its child too): killed at the deadline, the whole process group
    hang = processes.Server(
        "y",
        ["bash", "-c", "sleep 300 & sleep 300"],
        dict(os.environ),
        sorted(os.sched_getaffinity(0)),
        processes.free_port(),
        str(tmp_path / "b.log"),
        1.0,
    )
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="not ready after 1 s"):
        hang.__enter__()
    assert time.monotonic() - t0 < 40
    assert hang.proc.poll() is not None
    deadline = time.monotonic() + 10  # the killed background sleep may stay a zombie for a moment
    while time.monotonic() < deadline:
        try:
            os.killpg(hang.proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the server's process group outlived the failed start")


def test_offline_kvserve_side_smoke(model_factory, tmp_path):
    model_dir, _ = model_factory("llama_gqa")
    out = tmp_path / "peer.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvserve.cli",
            "bench",
            "peer",
            "--engines",
            "kvserve",
            "--model",
            model_dir,
            "--num-requests",
            "3",
            "--prompt-len",
            "4",
            "8",
            "--output-len",
            "2",
            "4",
            "--block-size",
            "16",
            "--kv-cache-gib",
            "0.01",
            "--cpus",
            cpu_pinning.format_cpus(sorted(os.sched_getaffinity(0))[:1]),
            "--json-out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert [r["engine"] for r in report["runs"]] == ["kvserve", "kvserve"]
    assert report["summary"]["kvserve"]["self_identical"] == 3
    assert all(r["output_tokens"] == report["workload"]["output_tokens"] for r in report["runs"])
    assert "=== kvserve bench peer: offline, bfloat16 ===" in proc.stdout

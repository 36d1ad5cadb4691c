"""`kvserve router` and `kvserve bench router` flags: registered, validated with a clear message."""

from __future__ import annotations

import pytest

from kvserve.cli.main import build_parser, main


def test_router_needs_exactly_one_source_of_replicas(capsys):
    assert main(["router"]) == 2
    assert "--backend" in capsys.readouterr().err
    assert main(["router", "--backend", "http://127.0.0.1:1", "--service", "llama"]) == 2
    assert main(["router", "--backend", "127.0.0.1:8000"]) == 2
    assert "must be an http(s) URL" in capsys.readouterr().err


def test_router_flags_and_weights():
    args = build_parser().parse_args(
        [
            "router",
            "--backend",
            "http://a:1",
            "--backend",
            "http://b:1",
            "--weight-prefill",
            "0",
            "--session-header",
            "x-session-id",
        ]
    )
    assert args.backend == ["http://a:1", "http://b:1"] and args.weight_prefill == 0.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--backend", "http://a:1", "--weight-queue", "-1"])
    bench = build_parser().parse_args(["bench", "router", "--runs", "router,random", "--repeat", "1"])
    assert bench.runs == "router,random" and bench.repeat == 1


def test_bench_rejects_unknown_runs(capsys):
    assert main(["bench", "router", "--runs", "router,roundrobin"]) == 2
    assert "roundrobin" in capsys.readouterr().err


def test_bench_knows_the_restart_runs():
    from kvserve.runtime.bench.router import RUNS

    assert {"restart", "restart-events"} <= set(RUNS)
    bench = build_parser().parse_args(["bench", "router", "--runs", "restart,restart-events", "--restart-at", "0.3"])
    assert bench.runs == "restart,restart-events" and bench.restart_at == 0.3

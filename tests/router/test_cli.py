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


def test_router_pd_flags(capsys):
    args = build_parser().parse_args(
        [
            "router",
            "--prefill-backend",
            "http://p:1",
            "--decode-backend",
            "http://d:1",
            "--pd-decider",
            "always",
            "--max-local-prefill-length",
            "512",
            "--remote-prefill-min-uncached-ratio",
            "0.5",
            "--max-prefill-queue",
            "4",
            "--prefill-timeout",
            "20",
        ]
    )
    assert args.prefill_backend == ["http://p:1"] and args.decode_backend == ["http://d:1"]
    assert (args.pd_decider, args.max_local_prefill_length, args.remote_prefill_min_uncached_ratio) == (
        "always",
        512,
        0.5,
    )
    assert (args.max_prefill_queue, args.prefill_timeout) == (4, 20.0)
    for bad in (
        ["--pd-decider", "sometimes"],
        ["--remote-prefill-min-uncached-ratio", "2"],
        ["--max-prefill-queue", "0"],
        ["--max-local-prefill-length", "-1"],
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["router", "--backend", "http://a:1", *bad])
    assert "sometimes" in capsys.readouterr().err
    # A prefill pool alone cannot answer; a role label is for discovered pods.
    assert main(["router", "--prefill-backend", "http://p:1"]) == 2
    assert "--decode-backend" in capsys.readouterr().err
    assert main(["router", "--decode-backend", "http://d:1", "--role-label", "llm-d.ai/role"]) == 2
    assert "--role-label needs --service" in capsys.readouterr().err
    assert main(["router", "--prefill-backend", "p:1", "--decode-backend", "http://d:1"]) == 2
    assert "--prefill-backend must be an http(s) URL" in capsys.readouterr().err


def test_bench_knows_the_restart_runs():
    from kvserve.runtime.bench.router import RUNS

    assert {"restart", "restart-events"} <= set(RUNS)
    bench = build_parser().parse_args(["bench", "router", "--runs", "restart,restart-events", "--restart-at", "0.3"])
    assert bench.runs == "restart,restart-events" and bench.restart_at == 0.3

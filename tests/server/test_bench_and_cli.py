"""`kvserve bench serve` runs end to end against a live server (tiny workloads), and the serve CLI parses
its vLLM-style flags."""

from __future__ import annotations

import argparse
import json

import pytest

from kvserve.cli import bench_serve, serve
from kvserve.cli.main import build_parser
from kvserve.runtime.bench import serve as bench_serve_impl
from kvserve.runtime.bench import serve_client

pytestmark = pytest.mark.timeout(120)


def test_serve_flags_parse():
    args = build_parser().parse_args(
        [
            "serve",
            "/models/x",
            "--port",
            "9000",
            "--served-model-name",
            "a",
            "b",
            "--no-enable-prefix-caching",
            "--kv-cache-bytes",
            "512MiB",
            "--max-queue-len",
            "8",
            "--drain-timeout",
            "5",
            "--api-key",
            "k",
        ]
    )
    assert args.model_dir == "/models/x" and args.port == 9000 and args.served_model_name == ["a", "b"]
    assert args.enable_prefix_caching is False and args.enable_chunked_prefill is True
    assert args.kv_cache_bytes == 512 << 20 and args.max_queue_len == 8 and args.drain_timeout == 5.0
    assert build_parser().parse_args(["serve"]).model_dir is None
    defaults = build_parser().parse_args(["serve"])
    assert defaults.max_request_body_bytes == 32 << 20 and defaults.max_consecutive_step_failures == 3
    limits = build_parser().parse_args(
        ["serve", "--max-request-body-bytes", "1MiB", "--max-consecutive-step-failures", "5"]
    )
    assert limits.max_request_body_bytes == 1 << 20 and limits.max_consecutive_step_failures == 5
    assert serve.parse_bytes("1G") == 1 << 30 and serve.parse_bytes("1048576") == 1 << 20
    with pytest.raises(argparse.ArgumentTypeError):
        serve.parse_bytes("lots")


def test_serve_rejects_missing_model_dir(tmp_path, capsys):
    args = build_parser().parse_args(["serve", str(tmp_path / "nope")])
    assert serve.run(args) == 2
    assert "not a model directory" in capsys.readouterr().err


@pytest.mark.parametrize("workload", ["random", "shared-prefix", "long-prompt"])
def test_bench_serve_workloads(server, tmp_path, workload):
    out, plot = tmp_path / "r.json", tmp_path / "r.png"
    args = build_parser().parse_args(
        [
            "bench",
            "serve",
            "--base-url",
            server.base_url,
            "--workload",
            workload,
            "--num-prompts",
            "6",
            "--request-rate",
            "20",
            "--input-len",
            "32",
            "--output-len",
            "6",
            "--range-ratio",
            "0.5",
            "--prefix-len",
            "64",
            "--suffix-len",
            "8",
            "--num-streams",
            "3",
            "--stream-output-len",
            "12",
            "--num-long-prompts",
            "1",
            "--long-prompt-len",
            "256",
            "--goodput",
            "ttft:5000",
            "tpot:1000",
            "--result-json",
            str(out),
            "--plot",
            str(plot),
        ]
    )
    assert bench_serve.run(args) == 0
    result = json.loads(out.read_text())
    metrics = result["metrics"]
    assert metrics["failed"] == 0
    assert result["prompts"] == "chat-templated text"  # the default: real text through the server's /tokenize
    if workload == "long-prompt":
        assert metrics["completed"] == 4 and metrics["steady_state_itl_ms"] > 0
        assert result["mixed"]["p99_itl_ms"] > 0
    else:
        assert metrics["completed"] == 6 and metrics["total_output_tokens"] >= 6
        for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "request_goodput", "output_throughput"):
            assert metrics[key] > 0, key
    assert plot.stat().st_size > 10_000


def test_arrivals_and_percentiles():
    import random

    delays = serve_client.arrival_delays(100, 10.0, 1.0, random.Random(0))
    assert delays[0] == 0 and delays == sorted(delays) and 9.0 < delays[-1] <= 10.0
    assert serve_client.arrival_delays(3, float("inf"), 1.0, random.Random(0)) == [0, 0, 0]
    assert serve_client.percentile([1, 2, 3, 4], 50) == 2.5 and serve_client.percentile([5], 99) == 5
    assert bench_serve_impl._parse_goodput(["ttft:200", "e2el:1000"]) == {"ttft": 0.2, "e2el": 1.0}


def test_api_server_counts_parse():
    from kvserve.runtime.bench.served_vs_offline import _api_server_counts

    assert _api_server_counts("1") == [1] and _api_server_counts("1, 2") == [1, 2]
    for bad in ("", "0", "1,1", "two"):
        with pytest.raises(ValueError, match="--api-server-counts"):
            _api_server_counts(bad)

"""`python -m kvserve.runtime.bench.pd_itl` (kvserve bench pd): the summary's arithmetic on made-up arrival
times, and a tiny real run of both stacks (demo model, a few hundred prompt tokens, under a minute)."""

from __future__ import annotations

import argparse
import json

import pytest

from kvserve.runtime.bench import pd_itl


def _args(**over) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    pd_itl.add_arguments(parser)
    return parser.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in over.items()])


def test_summary_counts_only_gaps_inside_the_window():
    raw = {
        "window": {"start": 10.0, "end": 12.0},
        # gaps ending at 10.1, 10.2, 11.2 are in; the one ending at 9.9 and the one ending at 12.5 are out
        "streams": [{"sent": 9.0, "arrivals": [9.5, 9.9, 10.1, 10.2, 11.2, 12.5]}],
        "longs": [{"sent": 10.0, "arrivals": [10.5, 10.6]}, {"sent": 11.0, "arrivals": [12.0]}],
    }
    s = pd_itl.summarize(raw)
    assert s["itl_samples"] == 3
    assert s["itl_median_ms"] == pytest.approx(200.0)
    assert s["itl_p99_ms"] == pytest.approx(1000.0) and s["itl_max_ms"] == pytest.approx(1000.0)
    assert s["long_ttft_median_s"] == pytest.approx(0.75) and s["long_ttft_max_s"] == pytest.approx(1.0)
    assert s["decode_tokens_per_s"] == pytest.approx(3 / 2)  # 10.1, 10.2, 11.2
    assert s["output_tokens_per_s"] == pytest.approx((3 + 3) / 2)


def test_bad_arguments_name_the_flag(capsys):
    assert pd_itl.main(_args(modes="pd,mixed")) == 2
    assert "--modes" in capsys.readouterr().err
    assert pd_itl.main(_args(long_rate=0)) == 2
    assert "--long-rate" in capsys.readouterr().err


def test_tiny_run_of_both_stacks(tmp_path, capsys):
    pytest.importorskip("nixl_cu12", reason="P/D disaggregation needs NIXL: pip install 'kvserve[disagg]'")
    out = tmp_path / "r.json"
    args = _args(
        model="demo",
        dtype="float32",
        decodes=2,
        decode_tokens=24,
        long_prompts=2,
        long_tokens=300,
        long_rate=4,
        long_output_tokens=4,
        max_local_prefill_length=64,
        kv_cache_bytes="64MiB",
        max_model_len=1024,
        timeout=60,
        ready_timeout=60,
        result_json=str(out),
    )
    assert pd_itl.main(args) == 0
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["pd", "agg"]
    for r in results.values():
        assert r["itl_samples"] > 0 and r["itl_p99_ms"] >= r["itl_median_ms"] > 0
        assert r["long_ttft_median_s"] > 0 and r["output_tokens_per_s"] > 0
        assert r["load_avg_1m_before"] >= 0
    # The long prompts (and the warm-up one) prefilled on the prefill engine, the decode streams locally.
    assert results["pd"]["router_pd_paths"].get("remote_prefill", 0) >= 3
    assert results["pd"]["router_pd_paths"].get("local", 0) >= 2
    table = capsys.readouterr().out
    assert "| metric | pd | agg | pd / agg |" in table
    for label, _, _ in pd_itl.FIELDS:
        assert f"| {label} |" in table

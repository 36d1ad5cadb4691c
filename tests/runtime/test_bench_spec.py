"""`kvserve bench spec` runs both configurations on the same requests and reports drafting off above the
load switch (a tiny run: the numbers themselves belong to docs/performance.md)."""

from __future__ import annotations

import json

from kvserve.cli.main import main as cli_main


def test_bench_spec_reports_both_configurations(stories_dir, tmp_path, capsys):
    out = tmp_path / "spec.json"
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "disable_by_batch_size": 2}'
    args = ["bench", "spec", "--model", stories_dir, "--streams", "1", "4", "--rounds", "1", "--max-tokens", "40"]
    assert cli_main([*args, "--speculative-config", spec, "--json-out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert {(r["workload"], r["streams"], r["spec"]) for r in results} == {
        (w, n, s) for w in ("repetitive", "random") for n in (1, 4) for s in (False, True)
    }
    assert all(r["output_tokens_per_s"] > 0 and r["tpot_ms"] > 0 for r in results)
    by_key = {(r["workload"], r["streams"], r["spec"]): r for r in results}
    assert by_key[("repetitive", 1, True)]["drafts"] > 0
    assert by_key[("repetitive", 4, True)]["drafts"] == 0  # 4 streams > disable_by_batch_size 2
    assert "drafting off" in capsys.readouterr().out

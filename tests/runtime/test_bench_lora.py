"""`kvserve bench lora` runs the base model with and without --enable-lora and batches of 1 and 2 adapters on
the same requests (a tiny run: the numbers themselves belong to docs/lora.md), and checks its own rows: the
adapters changed every request's tokens, the LoRA engine's base rows changed none."""

from __future__ import annotations

import json

from kvserve.cli.main import main as cli_main


def test_bench_lora_reports_every_configuration(stories_dir, tmp_path, capsys):
    out = tmp_path / "lora.json"
    args = ["bench", "lora", "--model", stories_dir, "--adapters", "1", "2", "--num-requests", "4"]
    assert cli_main([*args, "--max-tokens", "6", "--rank", "4", "--rounds", "1", "--json-out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["label"], r["adapters"], r["lora_engine"]) for r in rows] == [
        ("base, no --enable-lora", 0, False),
        ("base, --enable-lora", 0, True),
        ("1 adapter", 1, True),
        ("2 adapters", 2, True),
    ]
    assert all(r["output_tokens_per_s"] > 0 for r in rows)
    assert [r["rows_changed"] for r in rows] == [0, 0, 4, 4]
    assert "vs base" in capsys.readouterr().out


def test_bench_lora_needs_a_request_per_adapter(stories_dir, capsys):
    assert cli_main(["bench", "lora", "--model", stories_dir, "--adapters", "16", "--num-requests", "8"]) == 2
    assert "--num-requests (8) must be >= the most --adapters (16)" in capsys.readouterr().err

"""`kvserve bench step` runs end to end on the tiny pretrained model and measures only pure-decode steps
(what it reports is checked for consistency, never against a time: timings live in the benchmark)."""

from __future__ import annotations

from kvserve.cli.main import build_parser
from kvserve.runtime.bench.step import run_batch


def test_measures_pure_decode_steps(stories_dir):
    r = run_batch(stories_dir, num_decodes=6, prompt_len=20, num_steps=3, warmup_steps=1, block_size=16, seed=0)
    assert r.num_decodes == 6 and r.num_steps == 3
    assert 0 < r.model_ms < r.step_ms and 0 < r.core_host_best_ms <= r.core_host_ms
    assert r.schedule_ms > 0 and r.update_ms > 0 and r.sched_out_bytes > 0


def test_cli_is_registered():
    args = build_parser().parse_args(["bench", "step", "--batch-sizes", "8", "16", "--num-steps", "4"])
    assert args.batch_sizes == [8, 16] and args.num_steps == 4

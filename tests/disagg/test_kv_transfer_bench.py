"""The transfer benchmark runs end to end on a tiny shape (its numbers are not checked: timing on a shared
machine; its byte-equality checks are)."""

from __future__ import annotations

import pytest

pytest.importorskip("nixl_cu12", reason="P/D disaggregation needs NIXL: pip install 'kvserve[disagg]'")


def test_bench_runs_and_checks_bytes():
    from kvserve.runtime.bench.kv_transfer import run

    out = run(layers=2, kv_heads=2, head_dim=8, block_size=4, num_blocks=8, repeats=2, dtype="float32")
    assert out["bytes"] == 2 * 2 * 8 * 4 * 2 * 8 * 4 and out["descriptors"] == 32
    assert out["nixl_read_GBps"] > 0 and out["torch_memcpy_GBps"] > 0

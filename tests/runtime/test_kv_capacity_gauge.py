"""`kvserve:kv_capacity_tokens` is the capacity module's usable tokens, KV cache groups included: a
sliding-window model's groups share one pool, so the gauge must agree with the plan's kvTokens for it too."""

from __future__ import annotations

from prometheus_client import generate_latest

from kvserve.runtime import capacity
from kvserve.runtime.metrics import ServerMetrics
from kvserve.runtime.planner import catalog


def _gauge(metrics: ServerMetrics) -> float:
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith("kvserve:kv_capacity_tokens"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("kvserve:kv_capacity_tokens not exported")


def test_gauge_equals_the_layouts_usable_tokens_for_single_and_grouped_models():
    for name, expected_groups in (("llama-3-8b", 1), ("gemma-3-1b", 7)):  # gemma: 1 full + 6 sliding groups of 4
        layout = capacity.kv_layout(catalog.lookup_model(name), "bfloat16", "auto", 16, 1)
        assert layout.num_groups == expected_groups
        num_blocks = 1001
        metrics = ServerMetrics(name, 4096, {"num_blocks": num_blocks, "block_size": 16}, layout.num_groups)
        assert _gauge(metrics) == layout.usable_tokens(num_blocks)
    assert _gauge(metrics) == (num_blocks - 1) // 7 * 16  # gemma: 1000 usable blocks over its 7 groups

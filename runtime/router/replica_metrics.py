"""Parse a replica's Prometheus /metrics into the few numbers routing needs. Pure (text in, numbers out).

Accepts both vLLM generations of the KV gauge (`vllm:kv_cache_usage_perc`, older `vllm:gpu_cache_usage_perc`).
Capacity, most precise first: kvserve's `kvserve:kv_capacity_tokens` gauge; vLLM's `vllm:cache_config_info`
labels `num_gpu_blocks` x `block_size`; else None (the router's --default-capacity-tokens applies).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class ReplicaMetrics:
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    block_size: int | None = None
    capacity_tokens: int | None = None
    prefix_cache_queries: float = 0.0  # tokens looked up (cumulative)
    prefix_cache_hits: float = 0.0  # tokens found (cumulative)
    draining: bool = False  # kvserve:draining 1: the replica got a stop signal (it may still accept a while)


def _label_int(labels: dict[str, str], key: str) -> int | None:
    try:
        return int(labels[key])
    except (KeyError, ValueError):
        return None


def parse_metrics(text: str) -> ReplicaMetrics:
    """Sums over label sets (one engine per kvserve process; several in a multi-engine vLLM)."""
    values: dict[str, float] = {}
    info: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name == "vllm:cache_config_info":
                info = dict(sample.labels)
            elif name in ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"):
                values[name] = max(values.get(name, 0.0), sample.value)
            else:
                values[name] = values.get(name, 0.0) + sample.value
    kv = values.get("vllm:kv_cache_usage_perc", values.get("vllm:gpu_cache_usage_perc", 0.0))
    block_size = _label_int(info, "block_size")
    capacity = values.get("kvserve:kv_capacity_tokens")
    if not capacity:
        gpu_blocks = _label_int(info, "num_gpu_blocks")
        capacity = gpu_blocks * block_size if gpu_blocks and block_size else None
    return ReplicaMetrics(
        waiting=int(values.get("vllm:num_requests_waiting", 0)),
        running=int(values.get("vllm:num_requests_running", 0)),
        kv_usage=float(kv),
        block_size=block_size,
        capacity_tokens=int(capacity) if capacity else None,
        prefix_cache_queries=values.get("vllm:prefix_cache_queries_total", 0.0),
        prefix_cache_hits=values.get("vllm:prefix_cache_hits_total", 0.0),
        draining=values.get("kvserve:draining", 0.0) > 0,
    )

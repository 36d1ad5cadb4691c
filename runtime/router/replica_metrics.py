"""Parse a replica's Prometheus /metrics into the few numbers routing needs. Pure (text in, numbers out).

Accepts both vLLM generations of the KV gauge (`vllm:kv_cache_usage_perc`, older `vllm:gpu_cache_usage_perc`).
Capacity, most precise first: kvserve's `kvserve:kv_capacity_tokens` gauge; vLLM's `vllm:cache_config_info`
labels `num_gpu_blocks` x `block_size`; else None (the router's --default-capacity-tokens applies).
LoRA adapters (adapter affinity): vLLM's `vllm:lora_requests_info`, one series per (running, waiting)
combination whose value is the time it was last current, so only the newest series describes the replica now
(as the Gateway API Inference Extension's endpoint picker reads it); its labels are comma-joined adapter names.
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
    running_adapters: frozenset[str] = frozenset()  # adapters with running requests (vllm:lora_requests_info)
    waiting_adapters: frozenset[str] = frozenset()  # adapters with waiting requests
    max_loras: int | None = None  # its max_lora label: adapters one step can hold; None without LoRA


def _label_int(labels: dict[str, str], key: str) -> int | None:
    try:
        return int(labels[key])
    except (KeyError, ValueError):
        return None


def _names(label: str | None) -> frozenset[str]:
    return frozenset(n for n in (label or "").split(",") if n)


def parse_metrics(text: str) -> ReplicaMetrics:
    """Sums over label sets (one engine per kvserve process; several in a multi-engine vLLM)."""
    values: dict[str, float] = {}
    info: dict[str, str] = {}
    lora: dict[str, str] | None = None
    lora_time = float("-inf")
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name == "vllm:cache_config_info":
                info = dict(sample.labels)
            elif name == "vllm:lora_requests_info":
                if sample.value >= lora_time:
                    lora, lora_time = dict(sample.labels), sample.value
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
        running_adapters=_names(lora.get("running_lora_adapters")) if lora else frozenset(),
        waiting_adapters=_names(lora.get("waiting_lora_adapters")) if lora else frozenset(),
        max_loras=_label_int(lora, "max_lora") if lora else None,
    )

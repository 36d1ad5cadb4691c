"""Every Prometheus metric kvserve exports, defined once, with vLLM's names and buckets.

Existing vLLM dashboards, prometheus-adapter rules and KEDA triggers work unchanged: the HPA scales on
`vllm:num_requests_waiting` (the adapter exposes it as `vllm_num_requests_waiting`). Labels: `model_name`
and `engine` (always "0": one engine per process). prometheus_client appends `_total` to counter names on
exposition (`vllm:prompt_tokens_total`), exactly as vLLM's own exposition does.

Each `ServerMetrics` owns its own `CollectorRegistry`, so several servers (tests) can live in one process.
"""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
REQUEST_LATENCY_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
PARAMS_N_BUCKETS = [1, 2, 5, 10, 20]
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]

CONTENT_TYPE = CONTENT_TYPE_LATEST

# No `*_created` sample per series: vLLM dashboards do not use them and they double the scrape size.
disable_created_metrics()

# How prometheus-client's multiprocess mode (several API servers, runtime/metrics_group.py) combines each
# gauge across processes; ignored in a single process. Engine gauges are set by one API server only (the
# others leave them at 0), so "max" is that server's value; engine_alive is 0 once any server saw the
# engine dead.
GAUGE_MULTIPROCESS_MODES = {"kvserve:engine_alive": "min"}
DEFAULT_GAUGE_MULTIPROCESS_MODE = "max"


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count histogram buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class ServerMetrics:
    """The metrics of one served model. Gauges are set from engine stats after every step; counters are
    advanced by the difference between successive cumulative engine counters; histograms are observed by
    the async engine as tokens arrive and requests finish."""

    exports_engine_stats = True  # False: another API server of the group exports the core's gauges/counters

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        cache_info: dict[str, Any] | None = None,
        num_kv_cache_groups: int = 1,
        max_loras: int | None = None,
    ):
        self.registry = registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name", "engine"]
        self._label_values = {"model_name": model_name, "engine": "0"}
        token_buckets = build_1_2_5_buckets(max(1, max_model_len))

        def gauge(name: str, doc: str) -> Gauge:
            mode = GAUGE_MULTIPROCESS_MODES.get(name, DEFAULT_GAUGE_MULTIPROCESS_MODE)
            return Gauge(name, doc, labels, registry=registry, multiprocess_mode=mode).labels(**self._label_values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry).labels(**self._label_values)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry).labels(**self._label_values)

        # Gauges: current state (the autoscaling signals)
        self.num_requests_running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage_perc = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")

        # Counters (exposed with a _total suffix)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        # Speculative decoding (--speculative-config), vLLM's names (spec_decode/metrics.py): acceptance rate =
        # accepted / draft tokens, mean acceptance length = 1 + accepted / drafts.
        self.spec_num_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self._spec_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            [*labels, "position"],
            registry=registry,
        )
        # Swap preemption (vLLM V1 has no swapping, hence kvserve: names)
        self.num_swap_outs = counter("kvserve:num_swap_outs", "Requests preempted by swapping their KV to host memory.")
        self.num_swap_ins = counter("kvserve:num_swap_ins", "Swapped-out requests brought back to device memory.")

        # KV events (--kv-events-config, runtime/kv_events/): batches the publisher dropped because its queue was
        # full (subscribers see a sequence gap and replay or resync). vLLM exports no such counter: kvserve: name.
        self.kv_events_dropped_batches = counter(
            "kvserve:kv_events_dropped_batches", "KV event batches dropped because the publisher's queue was full."
        )
        self.kv_events_published_batches = counter(
            "kvserve:kv_events_published_batches", "KV event batches the publisher sent."
        )

        # The host KV tier (--kv-offloading-size), per tier (label tier="cpu"; kvserve: names, vLLM exports none)
        def tier_metric(kind, name: str, doc: str, extra: tuple[str, ...] = ()):
            return kind(name, doc, [*labels, "tier", *extra], registry=registry)

        self._kv_offload_hits = tier_metric(
            Counter, "kvserve:kv_offload_hit_blocks", "Prefix blocks loaded back from an offload tier, not recomputed."
        )
        self._kv_offload_lookups = tier_metric(
            Counter,
            "kvserve:kv_offload_lookup_blocks",
            "Prefix blocks looked up in an offload tier past a device miss.",
        )
        self._kv_offload_bytes = tier_metric(
            Counter, "kvserve:kv_offload_bytes", "KV bytes moved to (save) and from (load) an offload tier.", ("op",)
        )
        self._kv_offload_evictions = tier_metric(
            Counter, "kvserve:kv_offload_evicted_blocks", "Blocks an offload tier evicted (LRU)."
        )
        self._kv_offload_failed = tier_metric(
            Counter, "kvserve:kv_offload_failed_blocks", "Blocks an offload tier failed to return (missing, corrupt)."
        )
        self._kv_offload_used = tier_metric(Gauge, "kvserve:kv_offload_used_blocks", "Blocks an offload tier holds.")
        self._kv_offload_capacity = tier_metric(
            Gauge, "kvserve:kv_offload_capacity_blocks", "Blocks an offload tier can hold."
        )

        # P/D disaggregation (--kv-transfer-config, core/pd_connector.py): vLLM's NixlConnector names where it
        # has one (vllm:nixl_num_kv_expired_reqs, vllm:nixl_num_failed_transfers), kvserve: names for the rest.
        # Families without samples until the engine reports the connector on (pd_enabled).
        def pd_metric(kind, name: str, doc: str):
            return kind(name, doc, labels, registry=registry)

        self._pd_leases_held = pd_metric(
            Gauge, "kvserve:pd_leases_held", "Prefill engine: finished prefills whose blocks wait for a decode pull."
        )
        self._pd_leased_blocks = pd_metric(Gauge, "kvserve:pd_leased_blocks", "Prefill engine: KV blocks under lease.")
        self._pd_leases_expired = pd_metric(
            Counter,
            "vllm:nixl_num_kv_expired_reqs",
            "Prefill engine: leases freed after abort_request_timeout without the decode engine's notification.",
        )
        self._pd_pulled_tokens = pd_metric(
            Counter,
            "kvserve:pd_pulled_tokens",
            "Decode engine: prompt tokens whose KV was pulled from a prefill engine.",
        )
        self._pd_failed_pulls = pd_metric(
            Counter,
            "vllm:nixl_num_failed_transfers",
            "Decode engine: pulls that failed (handshake, READ, or lease ended); the prompt was recomputed locally.",
        )
        self._request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels + ["finished_reason"],
            registry=registry,
        )

        # Histograms
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.request_params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", PARAMS_N_BUCKETS
        )
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS
        )

        # Info: cache configuration as labels of a constant-1 gauge (vLLM's vllm:cache_config_info)
        info = {k: str(v) for k, v in (cache_info or {}).items()}
        if info:
            Gauge(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                sorted(info),
                registry=registry,
                multiprocess_mode=DEFAULT_GAUGE_MULTIPROCESS_MODE,
            ).labels(**info).set(1)

        # --enable-lora: vLLM's vllm:lora_requests_info exactly (no model_name/engine labels): one series per
        # (running, waiting) combination, its value the time it was last current; readers such as the
        # Gateway API Inference Extension's endpoint picker take the series with the newest value.
        self.lora_info = None
        self._max_loras = str(max_loras) if max_loras else None
        if max_loras:
            self.lora_info = Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=registry,
                multiprocess_mode=DEFAULT_GAUGE_MULTIPROCESS_MODE,
            )
        # Per adapter: requests accepted (vLLM has no per-adapter counter; lora_requests_info drops counts).
        self.lora_requests = None
        if max_loras:
            self.lora_requests = Counter(
                "kvserve:lora_requests",
                "Requests accepted per LoRA adapter (one per prompt, as vllm:request_success counts).",
                labels + ["lora_name"],
                registry=registry,
            )

        # kvserve-specific extras
        # What the pod really holds: usable blocks (null block excluded) x block size -- equal to the
        # operator's status.plan.kvTokens when the pod runs its rendered args (issue 16's contract).
        self.kv_capacity_tokens = gauge(
            "kvserve:kv_capacity_tokens",
            "KV-cache capacity in tokens: usable blocks (null block excluded) x block size / KV cache groups.",
        )
        if "num_blocks" in (cache_info or {}) and "block_size" in (cache_info or {}):
            from kvserve.runtime.capacity import usable_tokens

            self.kv_capacity_tokens.set(
                usable_tokens(int(cache_info["num_blocks"]), int(cache_info["block_size"]), num_kv_cache_groups)
            )
        self.http_rejected = Counter(
            "kvserve:http_requests_rejected",
            "Requests rejected before reaching the engine.",
            labels + ["reason"],
            registry=registry,
        )
        self.num_kv_blocks_free = gauge("kvserve:num_kv_blocks_free", "Free KV-cache blocks (cached ones included).")
        self.num_kv_blocks_total = gauge("kvserve:num_kv_blocks_total", "Total KV-cache blocks.")
        self.draining = gauge("kvserve:draining", "1 while the server drains after SIGTERM.")
        # What /health says, as a series: an engine that died while the HTTP side still answers scrapes.
        self.healthy = gauge("kvserve:healthy", "1 while /health answers 200 (engine running, not draining).")
        # Liveness: a step failure fails the requests in that step (retryable); enough in a row, or a dead
        # tensor-parallel worker, make the engine dead (engine_alive 0, /health 503, the process exits 1).
        self.engine_step_failures = counter(
            "kvserve:engine_step_failures", "Engine steps that failed as a whole (their requests got 503)."
        )
        self.engine_alive = gauge("kvserve:engine_alive", "1 while the engine can serve, 0 once it is dead.")
        self.engine_alive.set(1)
        # Seconds each start-up phase took (runtime/startup_phases.py), set once when the server is ready.
        self._startup_phase = Gauge(
            "kvserve:startup_phase_seconds",
            "Seconds each start-up phase took (phase=total: from the command's start to ready).",
            [*labels, "phase"],
            registry=registry,
            multiprocess_mode=DEFAULT_GAUGE_MULTIPROCESS_MODE,
        )
        self._last_counters: dict[str, float] = {}

    # ---- engine-side updates -------------------------------------------------------------------------
    def update_from_stats(self, stats: Any) -> None:
        """Set gauges and advance counters from an EngineStats snapshot (cumulative counters)."""
        if not self.exports_engine_stats:
            return
        self.num_requests_running.set(stats.num_requests_running)
        self.num_requests_waiting.set(stats.num_requests_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.num_kv_blocks_free.set(getattr(stats, "num_free_blocks", 0))
        self.num_kv_blocks_total.set(getattr(stats, "num_total_blocks", 0))
        running_loras = getattr(stats, "running_lora_adapters", None)
        if self.lora_info is not None and running_loras is not None:
            self.lora_info.labels(
                max_lora=self._max_loras,
                waiting_lora_adapters=",".join(stats.waiting_lora_adapters),
                running_lora_adapters=",".join(running_loras),
            ).set_to_current_time()
        iteration_tokens = 0
        for name in (
            "prompt_tokens",
            "generation_tokens",
            "num_preemptions",
            "prefix_cache_queries",
            "prefix_cache_hits",
            "num_swap_outs",
            "num_swap_ins",
            "spec_num_drafts",
            "spec_num_draft_tokens",
            "spec_num_accepted_tokens",
        ):
            value = getattr(stats, name, None)
            if value is None:
                continue
            delta = value - self._last_counters.get(name, 0)
            self._last_counters[name] = value
            if delta > 0:
                getattr(self, name).inc(delta)
                if name in ("prompt_tokens", "generation_tokens"):
                    iteration_tokens += delta
        if iteration_tokens:
            self.iteration_tokens.observe(iteration_tokens)
        if getattr(stats, "kv_offload_capacity_blocks", 0):
            self._update_kv_offload(stats)
        self._update_kv_events(stats)
        if stats.pd_enabled:
            self._update_pd(stats)
        for position, value in enumerate(getattr(stats, "spec_accepted_per_pos", ())):
            key = f"spec_accepted_pos_{position}"
            delta = value - self._last_counters.get(key, 0)
            self._last_counters[key] = value
            if delta > 0:
                self._spec_per_pos.labels(position=str(position), **self._label_values).inc(delta)

    def _update_kv_events(self, stats: Any) -> None:
        """--kv-events-config: the publisher's cumulative batch counts (absent or 0 without it)."""
        for name in ("kv_events_published_batches", "kv_events_dropped_batches"):
            value = getattr(stats, name, 0)
            delta = value - self._last_counters.get(name, 0)
            self._last_counters[name] = value
            if delta > 0:
                getattr(self, name).inc(delta)

    def _update_kv_offload(self, stats: Any) -> None:
        tier = dict(tier="cpu", **self._label_values)
        self._kv_offload_used.labels(**tier).set(stats.kv_offload_used_blocks)
        self._kv_offload_capacity.labels(**tier).set(stats.kv_offload_capacity_blocks)
        block_bytes = stats.kv_offload_block_bytes
        counters = [
            ("hits", stats.kv_offload_loaded_blocks, self._kv_offload_hits.labels(**tier)),
            ("lookups", stats.kv_offload_lookup_blocks, self._kv_offload_lookups.labels(**tier)),
            ("evictions", stats.kv_offload_evicted_blocks, self._kv_offload_evictions.labels(**tier)),
            (
                "load_bytes",
                stats.kv_offload_loaded_blocks * block_bytes,
                self._kv_offload_bytes.labels(op="load", **tier),
            ),
            (
                "save_bytes",
                stats.kv_offload_saved_blocks * block_bytes,
                self._kv_offload_bytes.labels(op="save", **tier),
            ),
        ]
        if getattr(stats, "kv_offload_disk_capacity_blocks", 0):
            disk = dict(tier="disk", **self._label_values)
            self._kv_offload_used.labels(**disk).set(stats.kv_offload_disk_used_blocks)
            self._kv_offload_capacity.labels(**disk).set(stats.kv_offload_disk_capacity_blocks)
            hits, written = stats.kv_offload_disk_hit_blocks, stats.kv_offload_disk_written_blocks
            counters += [
                ("disk_hits", hits, self._kv_offload_hits.labels(**disk)),
                ("disk_failed", stats.kv_offload_disk_failed_blocks, self._kv_offload_failed.labels(**disk)),
                ("disk_load_bytes", hits * block_bytes, self._kv_offload_bytes.labels(op="load", **disk)),
                ("disk_save_bytes", written * block_bytes, self._kv_offload_bytes.labels(op="save", **disk)),
            ]
        if getattr(stats, "kv_offload_remote_enabled", 0):  # the store's capacity and occupancy are its own
            remote = dict(tier="remote", **self._label_values)
            hits, written = stats.kv_offload_remote_hit_blocks, stats.kv_offload_remote_written_blocks
            counters += [
                ("remote_hits", hits, self._kv_offload_hits.labels(**remote)),
                ("remote_lookups", stats.kv_offload_remote_lookup_blocks, self._kv_offload_lookups.labels(**remote)),
                ("remote_failed", stats.kv_offload_remote_failed_blocks, self._kv_offload_failed.labels(**remote)),
                ("remote_load_bytes", hits * block_bytes, self._kv_offload_bytes.labels(op="load", **remote)),
                ("remote_save_bytes", written * block_bytes, self._kv_offload_bytes.labels(op="save", **remote)),
            ]
        for key, value, metric in counters:
            name = f"kv_offload_{key}"
            delta = value - self._last_counters.get(name, 0)
            self._last_counters[name] = value
            if delta > 0:
                metric.inc(delta)

    def _update_pd(self, stats: Any) -> None:
        self._pd_leases_held.labels(**self._label_values).set(stats.pd_leases_held)
        self._pd_leased_blocks.labels(**self._label_values).set(stats.pd_leased_blocks)
        for key, metric in (
            ("pd_leases_expired", self._pd_leases_expired),
            ("pd_pulled_tokens", self._pd_pulled_tokens),
            ("pd_failed_pulls", self._pd_failed_pulls),
        ):
            value = getattr(stats, key)
            delta = value - self._last_counters.get(key, 0)
            self._last_counters[key] = value
            counter = metric.labels(**self._label_values)  # the series shows 0 before the first event
            if delta > 0:
                counter.inc(delta)

    def set_startup_phases(self, phases: dict[str, float]) -> None:
        for phase, seconds in phases.items():
            self._startup_phase.labels(phase=phase, **self._label_values).set(seconds)

    def observe_lora_request(self, lora_name: str) -> None:
        if self.lora_requests is not None:
            self.lora_requests.labels(lora_name=lora_name, **self._label_values).inc()

    def observe_request_start(self, n: int, max_tokens: int | None) -> None:
        self.request_params_n.observe(n)
        if max_tokens is not None:
            self.request_params_max_tokens.observe(max_tokens)

    def observe_finished(
        self,
        *,
        finish_reason: str,
        num_prompt_tokens: int,
        num_generation_tokens: int,
        arrival_time: float,
        first_scheduled_time: float | None,
        first_token_time: float | None,
        finished_time: float,
    ) -> None:
        self._request_success.labels(finished_reason=finish_reason, **self._label_values).inc()
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generation_tokens)
        self.e2e_request_latency.observe(max(0.0, finished_time - arrival_time))
        if first_scheduled_time is not None:
            self.request_queue_time.observe(max(0.0, first_scheduled_time - arrival_time))
            self.request_inference_time.observe(max(0.0, finished_time - first_scheduled_time))
            if first_token_time is not None:
                self.request_prefill_time.observe(max(0.0, first_token_time - first_scheduled_time))
        if first_token_time is not None:
            self.request_decode_time.observe(max(0.0, finished_time - first_token_time))
            if num_generation_tokens > 1:
                self.time_per_output_token.observe((finished_time - first_token_time) / (num_generation_tokens - 1))

    def track_health(self, is_healthy: Callable[[], bool]) -> None:
        """Evaluate `is_healthy` at every scrape (the same predicate /health uses)."""
        self.healthy.set_function(lambda: 1.0 if is_healthy() else 0.0)

    def observe_failed(self) -> None:
        """A request the engine could not finish (step failure, dead engine): vLLM's finished_reason="error"."""
        self._request_success.labels(finished_reason="error", **self._label_values).inc()

    def set_engine_alive(self, alive: bool) -> None:
        self.engine_alive.set(1 if alive else 0)

    def reject(self, reason: str) -> None:
        self.http_rejected.labels(reason=reason, **self._label_values).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

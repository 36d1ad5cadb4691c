"""The router's own Prometheus metrics (`kvserve_router:*`), in a private registry per Router instance."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvserve.runtime.metrics import TTFT_BUCKETS

DECISION_BUCKETS = [0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25]
RATIO_BUCKETS = [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0]
# A cold start is image pull + weight load + warm-up: seconds for a small model, minutes for a 70B one.
HOLD_BUCKETS = [0.1, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600]


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kvserve_router:requests",
            "Requests dispatched, by replica and routing reason (adapter, prefix, load, session, only, retry).",
            ["replica", "reason"],
            registry=r,
        )
        self.responses = Counter(
            "kvserve_router:upstream_responses", "Upstream response status codes.", ["replica", "code"], registry=r
        )
        self.retries = Counter(
            "kvserve_router:retries",
            "Requests retried on another replica before any byte "
            "reached the client, by the replica that failed and why.",
            ["replica", "cause"],
            registry=r,
        )
        self.ejections = Counter(
            "kvserve_router:ejections", "Replicas taken out of rotation.", ["replica", "cause"], registry=r
        )
        self.failed = Counter(
            "kvserve_router:failed_requests",
            "Requests the router answered with an error itself.",
            ["cause"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "kvserve_router:client_disconnects",
            "Requests whose client went away; the upstream request was closed.",
            registry=r,
        )
        self.upstream_ttft = Histogram(
            "kvserve_router:upstream_ttft_seconds",
            "Dispatch to first upstream body byte (first SSE event when streaming).",
            ["replica"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.decision_seconds = Histogram(
            "kvserve_router:decision_seconds",
            "Tokenising, hashing and scoring one request.",
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.prefix_match_ratio = Histogram(
            "kvserve_router:prefix_match_ratio",
            "Matched fraction of the prompt's blocks on the chosen replica.",
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "kvserve_router:in_flight_requests", "Requests in flight per replica.", ["replica"], registry=r
        )
        self.index_blocks = Gauge(
            "kvserve_router:prefix_index_blocks", "Block hashes in the replica's prefix index.", ["replica"], registry=r
        )
        self.replicas = Gauge("kvserve_router:replicas", "Known replicas by state.", ["state"], registry=r)
        # Scale from zero (--max-held-requests): the demand KEDA scales a model at zero replicas on.
        self.held = Gauge(
            "kvserve_router:held_requests",
            "Requests held now because no replica is ready (all models).",
            registry=r,
        )
        self.hold_outcomes = Counter(
            "kvserve_router:hold_outcomes",
            "Held requests by how their hold ended: forwarded, hold_timeout, queue_full, too_many_models, client_gone.",
            ["outcome"],
            registry=r,
        )
        self.hold_seconds = Histogram(
            "kvserve_router:hold_seconds",
            "Time a request was held before it was forwarded.",
            buckets=HOLD_BUCKETS,
            registry=r,
        )

        # P/D mode (router/pd.py)
        self.pd_requests = Counter(
            "kvserve_router:pd_requests",
            "Requests in P/D mode by path (remote_prefill, local, fallback) and why: local -- short, cached, "
            "prefill_saturated, disabled, no_prefill_replica, same_replica; fallback -- the prefill leg's failure "
            "(connect_error, reset, timeout, http_<code>, no_kv_transfer_params, bad_answer).",
            ["path", "reason"],
            registry=r,
        )
        self.prefill_leg_seconds = Histogram(
            "kvserve_router:prefill_leg_seconds",
            "P leg latency: dispatch to the prefill replica's whole answer (or its failure), by outcome.",
            ["replica", "outcome"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

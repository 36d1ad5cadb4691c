"""Metrics of one API server among several sharing one engine core (`kvserve serve --api-server-count N`).

prometheus-client's multiprocess mode: the launcher sets PROMETHEUS_MULTIPROC_DIR (a fresh directory) before
any API server starts, so every metric value lives in that directory's mmap files, and /metrics on any
server renders the whole group (MultiProcessCollector):

- per-request metrics (latency histograms, vllm:request_success, kvserve:http_requests_rejected) are
  observed by the server that answered the request and summed;
- the core's gauges and counters (running / waiting -- the autoscaling signal --, KV usage, token and
  prefix-cache counters, preemptions, step failures, vllm:iteration_tokens_total) reach every server in
  every step's stats, so only API server 0 exports them (the others would multiply the counters by N); its
  waiting count includes its own requests not yet seen by the core, the other servers' ones count from the
  core's next step on;
- kvserve:healthy is what the answering server's /health says (a live value, not a file).
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from kvserve.runtime.metrics import ServerMetrics

_LOCAL = "kvserve:healthy"


class _Discard:
    """Stands in for a counter this server must not advance."""

    def inc(self, amount: float = 1) -> None:
        pass


class GroupServerMetrics(ServerMetrics):
    def __init__(self, server_index: int, *args: Any, **kwargs: Any):
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            raise RuntimeError(
                "GroupServerMetrics needs PROMETHEUS_MULTIPROC_DIR set before prometheus_client "
                "is imported (the API-server group launcher sets it)"
            )
        self.exports_engine_stats = server_index == 0
        super().__init__(*args, **kwargs)
        if not self.exports_engine_stats:
            self.engine_step_failures = _Discard()
        self._is_healthy = lambda: False
        self._scrape = CollectorRegistry(auto_describe=False)
        self._scrape.register(_GroupCollector(self))

    def track_health(self, is_healthy) -> None:
        self._is_healthy = is_healthy

    def render(self) -> bytes:
        return generate_latest(self._scrape)


class _GroupCollector:
    def __init__(self, metrics: GroupServerMetrics):
        self.metrics = metrics

    def collect(self):
        from prometheus_client.multiprocess import MultiProcessCollector

        for family in MultiProcessCollector(None).collect():
            if family.name != _LOCAL:
                yield family
        m = self.metrics
        health = GaugeMetricFamily(
            _LOCAL, "1 while /health answers 200 (engine running, not draining).", labels=list(m._label_values)
        )
        health.add_metric(list(m._label_values.values()), 1.0 if m._is_healthy() else 0.0)
        yield health

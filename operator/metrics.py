"""The operator's own Prometheus metrics, served on /metrics by `kvserve operator --metrics-port`.

Two kinds:
- Reconcile counters and a duration histogram per trigger (change, child, resync), so an operator that is
  failing or slow shows up before its InferenceServices drift.
- Per InferenceService, the capacity plan and the status as gauges (labels `namespace`, `inferenceservice`),
  so "KV used vs planned" can be drawn and alerted on next to the engines' own metrics. The chart's PodMonitor
  puts the same `inferenceservice` label on every engine series, which is what the dashboard and the alert
  rules join on. The chart's ServiceMonitor scrapes this endpoint with honorLabels, so `namespace` here is
  the InferenceService's namespace, not the operator's.

Names use the `kvserve_` prefix (not `vllm:`): one name, one source. The per-object gauges are produced by a
collector from the last recorded snapshot of each object, so a deleted InferenceService leaves no stale series.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvserve.operator.spec_model import InferenceServiceSpec
from kvserve.runtime.planner.kv_plan import Plan

REGISTRY = CollectorRegistry(auto_describe=True)
# Reconciles are API round trips: tens of ms normally, seconds when the API server is slow.
RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

RECONCILES = Counter(
    "kvserve_operator_reconciles",
    "InferenceService reconciles by trigger and result.",
    ["trigger", "result"],
    registry=REGISTRY,
)
RECONCILE_ERRORS = Counter(
    "kvserve_operator_reconcile_errors",
    "Reconciles that raised, by trigger and exception type.",
    ["trigger", "error"],
    registry=REGISTRY,
)
RECONCILE_DURATION = Histogram(
    "kvserve_operator_reconcile_duration_seconds",
    "Time one reconcile took.",
    ["trigger"],
    buckets=RECONCILE_BUCKETS,
    registry=REGISTRY,
)

# (metric suffix, Plan attribute, help): the plan figures a dashboard or alert compares the engines against.
PLAN_GAUGES = (
    ("plan_kv_tokens", "kv_tokens", "Planned KV-cache capacity of one replica, in tokens."),
    ("plan_max_concurrency", "max_concurrency", "Planned sequences of maxModelLen tokens that fit at once."),
    ("plan_num_blocks_per_gpu", "num_blocks_per_gpu", "Planned KV-cache blocks per GPU rank."),
    ("plan_kv_cache_bytes_per_gpu", "kv_cache_bytes_per_gpu", "Planned KV-cache bytes per GPU rank."),
    ("plan_block_size_tokens", "block_size", "Tokens per KV-cache block."),
)


@dataclass(frozen=True)
class Snapshot:
    """What one reconcile saw and decided for one InferenceService."""

    plan: Plan | None
    conditions: tuple[tuple[str, str], ...]  # (type, status) with status True/False/Unknown
    desired_replicas: int
    ready_replicas: int
    autoscaling: dict | None  # the HPA's bounds (Resolved.autoscaling) when autoscaling is enabled, else None


class _InferenceServiceCollector(Collector):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._objects: dict[tuple[str, str], Snapshot] = {}

    def record(self, namespace: str, name: str, snapshot: Snapshot) -> None:
        with self._lock:
            self._objects[(namespace, name)] = snapshot

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._objects.pop((namespace, name), None)

    def __contains__(self, key: tuple[str, str]) -> bool:
        with self._lock:
            return key in self._objects

    def clear(self) -> None:
        with self._lock:
            self._objects.clear()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            objects = sorted(self._objects.items())
        labels = ["namespace", "inferenceservice"]

        def family(suffix: str, doc: str, extra: list[str] | None = None) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"kvserve_inferenceservice_{suffix}", doc, labels=labels + (extra or []))

        plan_families = [(family(suffix, doc), attr) for suffix, attr, doc in PLAN_GAUGES]
        fits = family("plan_fits", "1 when the capacity plan fits the GPUs (CapacityPlanned=True).")
        condition = family(
            "condition",
            "1 for the current status of each condition type (True, False or Unknown), 0 for the other two.",
            ["type", "status"],
        )
        desired = family("desired_replicas", "spec.replicas (what the HPA or the user asks for).")
        ready = family("ready_replicas", "Ready engine pods, from the Deployment's status.")
        max_replicas = family(
            "autoscaling_max_replicas",
            "The HPA's maxReplicas (autoscaling on only): spec.autoscaling's, else spec.slo's plan, else the default.",
        )
        min_replicas = family(
            "autoscaling_min_replicas",
            "The HPA's minReplicas (autoscaling on only): spec.autoscaling's, else spec.slo's plan, else the default.",
        )
        target = family(
            "autoscaling_target_queue_depth",
            "The HPA's target of waiting requests per pod: spec.autoscaling's, else spec.slo's plan, else the default.",
        )
        for (namespace, name), snap in objects:
            key = [namespace, name]
            if snap.plan is not None:
                for fam, attr in plan_families:
                    fam.add_metric(key, getattr(snap.plan, attr))
                fits.add_metric(key, 1.0 if snap.plan.fits else 0.0)
            for ctype, status in snap.conditions:
                for value in ("True", "False", "Unknown"):
                    condition.add_metric(key + [ctype, value], 1.0 if status == value else 0.0)
            desired.add_metric(key, snap.desired_replicas)
            ready.add_metric(key, snap.ready_replicas)
            if snap.autoscaling is not None:
                max_replicas.add_metric(key, snap.autoscaling["maxReplicas"])
                min_replicas.add_metric(key, snap.autoscaling["minReplicas"])
                target.add_metric(key, snap.autoscaling["targetQueueDepth"])
        yield from (fam for fam, _ in plan_families)
        yield from (fits, condition, desired, ready, max_replicas, min_replicas, target)


INFERENCE_SERVICES = _InferenceServiceCollector()
REGISTRY.register(INFERENCE_SERVICES)


def record(
    namespace: str,
    name: str,
    *,
    spec: InferenceServiceSpec,
    plan: Plan | None,
    status: dict,
    bounds: dict | None = None,
) -> None:
    """Called at the end of each reconcile with the spec (defaults applied), the plan, the new status and the
    HPA's bounds (Resolved.autoscaling; spec.autoscaling's own values when the spec did not resolve)."""
    autoscaling = {**spec.autoscaling.model_dump(by_alias=True, exclude_none=True), **(bounds or {})}
    INFERENCE_SERVICES.record(
        namespace,
        name,
        Snapshot(
            plan=plan,
            conditions=tuple((c["type"], c["status"]) for c in status.get("conditions") or []),
            desired_replicas=spec.replicas,
            ready_replicas=int(status.get("readyReplicas") or 0),
            autoscaling=autoscaling if spec.autoscaling.enabled else None,
        ),
    )


def forget(namespace: str, name: str) -> None:
    INFERENCE_SERVICES.forget(namespace, name)


@contextmanager
def timed_reconcile(trigger: str) -> Iterator[None]:
    """Counts and times one reconcile; an exception is counted as an error and re-raised."""
    start = time.perf_counter()
    try:
        yield
    except Exception as exc:
        RECONCILES.labels(trigger=trigger, result="error").inc()
        RECONCILE_ERRORS.labels(trigger=trigger, error=type(exc).__name__).inc()
        raise
    else:
        RECONCILES.labels(trigger=trigger, result="success").inc()
    finally:
        RECONCILE_DURATION.labels(trigger=trigger).observe(time.perf_counter() - start)


def serve(port: int, addr: str = "0.0.0.0") -> tuple[object, threading.Thread]:
    """Serve /metrics from a daemon thread (prometheus_client's own WSGI server)."""
    return start_http_server(port, addr=addr, registry=REGISTRY)

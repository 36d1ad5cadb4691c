"""PlanDrift's I/O and memory: on each resync, scrape every ready engine pod's /metrics, keep each pod's last
scrape and standing, and give reconcile the `PlanDrift` condition. The decisions are operator/plan_drift.py's.

Only InferenceServices with spec.slo have a planned step-time model to compare with (status.fleet); the others
carry no PlanDrift condition. The memory is the operator's own: a restarted operator starts measuring again and
keeps the last written condition until a pod is judged; a changed plan starts over at NotMeasured. A replica of
several pods is scraped on its leader (worker index 0), the pod that serves HTTP; the router's pods are not
engines.

Settings: plan_drift.DriftSettings' defaults, each overridable by an environment variable of the operator's
Deployment (ENV below). The scrape of one InferenceService's pods runs in parallel, `scrape_timeout_s` each, so
a resync waits for an unreachable pod at most that long.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvserve.operator import fleet, metrics
from kvserve.operator.plan_drift import (
    Counters,
    DriftSettings,
    PodDrift,
    advance,
    condition,
    judge,
    parse_counters,
    predict,
    window,
)
from kvserve.runtime.planner.fleet import Candidate
from kvserve.runtime.planner.simulator import Workload

CONDITION = "PlanDrift"
# DriftSettings field -> the environment variable that overrides its default
ENV = {
    "tpot_tolerance": "KVSERVE_DRIFT_TPOT_TOLERANCE",
    "ttft_tolerance": "KVSERVE_DRIFT_TTFT_TOLERANCE",
    "resyncs": "KVSERVE_DRIFT_RESYNCS",
    "min_requests": "KVSERVE_DRIFT_MIN_REQUESTS",
    "scrape_timeout_s": "KVSERVE_DRIFT_SCRAPE_TIMEOUT_SECONDS",
}
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"  # render/multinode.py's; "0" on leaders
MAX_PARALLEL_SCRAPES = 16
# Seconds of simulation one resync of one InferenceService may start (a new load level costs about half a second,
# a repeated one nothing: plan_drift.predict is memoised); pods past it are judged at a later resync.
PREDICTION_BUDGET_S = 1.0
NETWORK_POLICY_HINT = "add the operator's namespace to spec.networkPolicy.from (docs/operator.md, PlanDrift)"


def settings_from_env(env: Mapping[str, str]) -> DriftSettings:
    """DriftSettings with the overrides set in `env`; raises ValueError naming the variable."""
    types = {f.name: f.type for f in dataclasses.fields(DriftSettings)}
    values = {}
    for name, var in ENV.items():
        if var in env:
            cast = int if types[name] in (int, "int") else float
            try:
                values[name] = cast(env[var])
            except ValueError:
                kind = "an integer" if cast is int else "a number"
                raise ValueError(f"{var} must be {kind}, got {env[var]!r}") from None
    try:
        return DriftSettings(**values)
    except ValueError as exc:
        raise ValueError(f"{exc} (environment: {', '.join(f'{ENV[k]}={v}' for k, v in values.items())})") from None


SETTINGS = settings_from_env(os.environ)


@dataclass(frozen=True)
class _PodWatch:
    baseline: Counters  # the window's start: the last scrape that began a window
    standing: PodDrift = PodDrift()


@dataclass(frozen=True)
class _ObjectWatch:
    plan: tuple[Candidate, Workload]  # what the pods are compared with; a new plan starts over
    pods: dict[str, _PodWatch] = field(default_factory=dict)  # pod name -> its watch
    waiting: str = ""  # why a pod could not be measured at the last resync
    # pod name -> (scrapes failed in a row, resyncs left to skip it): an unreachable pod (a NetworkPolicy that
    # does not admit the operator, a hung server) costs the resync its timeout ever more rarely
    backoff: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Begun by this process without a plan change (operator start, leader hand-over): until a pod is judged, the
    # condition the status already holds stands (the memory of the windows behind it went with the old process).
    inherited: bool = True


MAX_SKIPPED_RESYNCS = 15


def _skip_after(failures: int) -> int:
    """Resyncs to skip a pod after `failures` failed scrapes in a row: 0, 1, 3, 7, 15, 15, ..."""
    return min(2 ** (failures - 1) - 1, MAX_SKIPPED_RESYNCS)


_objects: dict[tuple[str, str], _ObjectWatch] = {}
_guard = threading.Lock()


def _engine_pods(pods: list[dict], port: int) -> dict[str, str]:
    """pod name -> its /metrics URL, for ready engine pods that serve HTTP (a multi-pod replica's leader)."""
    out = {}
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        pod_labels = meta.get("labels") or {}
        if meta.get("deletionTimestamp") or pod_labels.get("app.kubernetes.io/component") != "engine":
            continue
        if pod_labels.get(WORKER_INDEX_LABEL, "0") != "0" or not status.get("podIP"):
            continue
        if not any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []):
            continue
        out[meta.get("name", "?")] = f"http://{status['podIP']}:{port}/metrics"
    return out


def _scrape(url: str, timeout_s: float) -> tuple[str | None, str]:
    """(the /metrics text, "") or (None, why not)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.read().decode("utf-8", errors="replace"), ""
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return None, f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"


def planned(resolved_fleet: fleet.Option | None, raw_spec: dict) -> tuple[Candidate, Workload] | None:
    """What a pod is compared with: the replica spec.slo's plan chose (engine shape, step-time model) and
    spec.workload (request count, prefix, seed); None without spec.slo."""
    if resolved_fleet is None:
        return None
    target = fleet.target_from_spec(raw_spec)
    return (resolved_fleet.candidate, target.workload) if target is not None else None


def observe(namespace: str, name: str, planned: tuple[Candidate, Workload] | None, pods: list[dict], port: int) -> None:
    """One resync's measurement: scrape the ready engine pods, advance each pod's standing. `planned`: the
    replica the plan chose and spec.workload (None: no spec.slo, nothing to compare with). Called under the
    InferenceService's reconcile lock; the module's lock is held only to read and swap the watch, not while
    scraping or simulating."""
    if planned is None:
        forget(namespace, name)
        return
    with _guard:
        before = _objects.get((namespace, name))
    if before is None or before.plan != planned:
        before = _ObjectWatch(planned, inherited=before is None)
    urls = _engine_pods(pods, port)
    backoff = {pod: before.backoff[pod] for pod in urls if pod in before.backoff}
    skipped = {pod for pod, (_, left) in backoff.items() if left > 0}
    due = {pod: url for pod, url in urls.items() if pod not in skipped}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(MAX_PARALLEL_SCRAPES, len(due)))) as pool:
        texts = dict(zip(due, pool.map(lambda u: _scrape(u, SETTINGS.scrape_timeout_s), due.values())))
    now_s = started_s = time.monotonic()
    # Pods gone (deleted, or no longer ready) are dropped: a pod's next window starts afresh.
    after = {pod: w for pod, w in before.pods.items() if pod in urls}
    problems = []
    for pod in sorted(skipped):
        failed, left = backoff[pod]
        backoff[pod] = (failed, left - 1)
        problems.append(f"pod {pod}: not scraped for {left} more resyncs after {failed} failed scrapes")
    for pod, (text, why) in texts.items():
        try:
            counters = parse_counters(text, now_s) if text is not None else None
        except ValueError as exc:
            counters, why = None, f"not Prometheus text ({exc})"
        if counters is None:
            failed = backoff.get(pod, (0, 0))[0] + 1
            backoff[pod] = (failed, _skip_after(failed))
            problems.append(f"pod {pod}: cannot read {urls[pod]}: {why}")
            continue
        backoff.pop(pod, None)
        current = after.get(pod)
        if current is None:
            after[pod] = _PodWatch(counters)
            continue
        measured = window(current.baseline, counters)
        if measured is None or measured.requests == 0:  # restarted, or idle: the window starts again here, so
            after[pod] = dataclasses.replace(current, baseline=counters)  # an idle spell never dilutes a busy one
            continue
        if measured.requests < SETTINGS.min_requests:  # too few requests yet: the window grows until the next resync
            continue
        if time.monotonic() - started_s > PREDICTION_BUDGET_S:  # judged at a later resync, its window grown
            continue
        try:
            predicted = predict(*planned, measured)
        except (ValueError, RuntimeError) as exc:  # e.g. a measured prompt the planned KV pool cannot hold
            problems.append(f"pod {pod}: no prediction for its load ({exc})")
            continue
        judgement = judge(measured, predicted, SETTINGS)
        if judgement is not None:
            after[pod] = _PodWatch(counters, advance(current.standing, judgement, SETTINGS))
    waiting = "; ".join(problems) if problems else ("" if urls else "no ready engine pod to measure")
    if any("cannot read" in p for p in problems):
        waiting += f" (is the operator admitted to the engine's port? {NETWORK_POLICY_HINT})"
    with _guard:
        _objects[(namespace, name)] = _ObjectWatch(planned, after, waiting, backoff, before.inherited)


def current(namespace: str, name: str, planned: object | None, previous: dict | None) -> tuple[bool, str, str] | None:
    """The PlanDrift condition (status, reason, message) from what was measured; None without spec.slo.
    `previous`: the condition as the status holds it, kept while nothing was judged since the operator started
    (its memory is in-process)."""
    if planned is None:
        return None
    with _guard:
        watch = _objects.get((namespace, name))
        standing = {pod: w.standing for pod, w in watch.pods.items()} if watch is not None else {}
        waiting = watch.waiting if watch is not None else ""
        inherited = watch is None or watch.inherited
    judged = any(p.last is not None for p in standing.values())
    if inherited and not judged and previous and previous.get("reason") not in (None, "NotMeasured"):
        return previous.get("status") == "True", previous["reason"], previous.get("message", "")
    return condition(standing, SETTINGS, waiting)


def forget(namespace: str, name: str) -> None:
    with _guard:
        _objects.pop((namespace, name), None)


def clear() -> None:
    with _guard:
        _objects.clear()


class _DriftCollector(Collector):
    """kvserve_inferenceservice_plan_drift_ratio{pod, metric}: measured / planned of each pod's last judged
    window (1.0 is on plan), beside the PlanDrift condition gauge that operator/metrics.py exports."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "kvserve_inferenceservice_plan_drift_ratio",
            "Measured over planned latency of each engine pod's last judged window (TPOT, TTFT); 1 is on plan.",
            labels=["namespace", "inferenceservice", "pod", "metric"],
        )
        with _guard:
            rows = [
                (key, pod, d)
                for key, watch in sorted(_objects.items())
                for pod, w in sorted(watch.pods.items())
                if w.standing.last is not None
                for d in w.standing.last.deviations
            ]
        for (namespace, name), pod, d in rows:
            family.add_metric([namespace, name, pod, d.metric], d.measured_s / d.planned_s)
        yield family


metrics.REGISTRY.register(_DriftCollector())

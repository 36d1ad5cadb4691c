"""Against live endpoints on 127.0.0.1: a real `kvserve serve` (the built-in demo model), the operator's /metrics
(the real collector, fed by a reconcile's status of examples/llama70b.yaml) and a real Prometheus scraping both.

- Every metric the dashboard and the alert rules read is one of those endpoints really exposes.
- Under a small bounded load, the prometheus-adapter rule's query and the KEDA trigger's query (both taken from
  the rendered chart) return the queue depth through Prometheus's HTTP API, and 0 once the queue drains.
- The rendered rules load into the real server and evaluate without errors; every dashboard panel returns data.

Every process is started under `timeout` (it stops itself even if pytest dies) and stopped by the fixtures.
Static scrape targets stand in for Kubernetes discovery: they carry the labels the chart's PodMonitor and
Prometheus Operator would give (namespace, pod, inferenceservice), and the operator job uses honor_labels
like the chart's ServiceMonitor.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from kvserve.operator import metrics as operator_metrics
from kvserve.operator import spec as spec_mod
from kvserve.operator import status as status_mod
from tests.monitoring.promql import (
    ROOT,
    binary,
    dashboard,
    exposed_sample_names,
    metric_names,
    prometheus_rule_groups,
    recorded_names,
    render_chart,
    rule_exprs,
    substitute,
    variable_selectors,
)

pytestmark = pytest.mark.timeout(300)
NAMESPACE, NAME, POD = "ml", "llama70b", "llama70b-7d9f8c-x2x4q"
API_KEY = "monitoring-test-key"
PROCESS_LIMIT_S = 240  # hard stop for every process started here
NUM_REQUESTS, MAX_REQUESTS, MAX_TOKENS = 16, 64, 96
SETTLED_S = 3  # > scrape_interval + scrape_timeout: every sample up to now - SETTLED_S is in the TSDB


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, log: Path, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        assert proc.poll() is None, log.read_text()[-4000:]
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} not ready after {deadline_s}s:\n{log.read_text()[-4000:]}"
        time.sleep(0.2)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    """`kvserve serve` on the demo model: 2 running seats, so a queue forms under the load below."""
    from kvserve.runtime.demo_model import ensure_demo_model

    tmp = tmp_path_factory.mktemp("serve")
    model_dir = ensure_demo_model(tmp / "cache")
    exe = Path(sys.executable).with_name("kvserve")
    port = _free_port()
    log = tmp / "serve.log"
    cmd = [
        "timeout",
        str(PROCESS_LIMIT_S),
        str(exe),
        "serve",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        NAME,
        "--max-num-seqs",
        "2",
        "--max-model-len",
        "1024",
        "--kv-cache-bytes",
        "32MiB",
        "--api-key",
        API_KEY,
        "--log-level",
        "warning",
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_http(base + "/health", proc, log, 150)
        yield base
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def operator_endpoint():
    """The operator's /metrics with one InferenceService recorded the way a reconcile records it."""
    operator_metrics.INFERENCE_SERVICES.clear()
    resolved = spec_mod.resolve(yaml.safe_load((ROOT / "examples" / "llama70b.yaml").read_text())["spec"])
    deployment = {
        "metadata": {"generation": 1},
        "status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1, "observedGeneration": 1},
    }
    status = status_mod.compute_status(
        name=NAME,
        namespace=NAMESPACE,
        spec=resolved.spec,
        generation=1,
        plan=resolved.plan,
        plan_reason=resolved.plan.reason,
        plan_message=resolved.plan.message,
        deployment=deployment,
        previous=None,
        now="2026-01-01T00:00:00Z",
    )
    with operator_metrics.timed_reconcile("change"):
        operator_metrics.record(NAMESPACE, NAME, spec=resolved.spec, plan=resolved.plan, status=status)
    with pytest.raises(RuntimeError), operator_metrics.timed_reconcile("resync"):
        raise RuntimeError("simulated API error")
    port = _free_port()
    server, _ = operator_metrics.serve(port, addr="127.0.0.1")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.shutdown()
        operator_metrics.INFERENCE_SERVICES.clear()


def _completion(client: httpx.Client | httpx.AsyncClient, prompt: str, max_tokens: int):
    return client.post(
        "/v1/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True},
    )


def test_dashboard_and_rules_read_only_metrics_that_are_exported(serve, operator_endpoint):
    with httpx.Client(base_url=serve, timeout=60) as client:
        assert _completion(client, "warm up", 4).status_code == 200  # labelled counters appear on first use
        assert client.post("/v1/completions", json={"model": NAME, "prompt": "x"}).status_code == 401
    exported = exposed_sample_names(httpx.get(serve + "/metrics", timeout=10).text)
    operator_exported = exposed_sample_names(httpx.get(operator_endpoint + "/metrics", timeout=10).text)
    assert "vllm:num_requests_waiting" in exported and "kvserve_inferenceservice_plan_kv_tokens" in operator_exported
    groups = prometheus_rule_groups(render_chart("monitoring.prometheusRule.enabled=true"))
    known = exported | operator_exported | {"up"}  # `up`: Prometheus's own per-target series
    problems = []
    for where, expr in (
        [(f"panel {t}", substitute(e)) for t, e in _dashboard_targets()]
        + [(f"variable {v}", substitute(s)) for v, s in variable_selectors()]
        + [(f"rule {n}", e) for n, e in rule_exprs(groups)]
    ):
        unknown = metric_names(expr) - known - recorded_names(groups)
        if unknown:
            problems.append(f"{where}: {sorted(unknown)}")
    assert not problems, "metrics nobody exports:\n" + "\n".join(problems)


def _dashboard_targets() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard()["panels"] for t in p.get("targets", [])]


@pytest.fixture(scope="module")
def prometheus(serve, operator_endpoint, tmp_path_factory):
    exe = binary("prometheus")
    tmp = tmp_path_factory.mktemp("prometheus")
    docs = render_chart(
        "monitoring.prometheusRule.enabled=true",
        "keda.enabled=true",
        f"keda.scaledObjects[0].name={NAME}",
        f"keda.scaledObjects[0].namespace={NAMESPACE}",
    )
    (tmp / "rules.yaml").write_text(yaml.safe_dump(prometheus_rule_groups(docs)))
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rules.yaml"],
        "scrape_configs": [
            {
                "job_name": f"{NAMESPACE}/kvs-kvserve-engines",
                "static_configs": [
                    {
                        "targets": [serve.removeprefix("http://")],
                        "labels": {"namespace": NAMESPACE, "pod": POD, "inferenceservice": NAME},
                    }
                ],
            },
            {
                "job_name": "kvs-kvserve-metrics",
                "honor_labels": True,
                "static_configs": [
                    {
                        "targets": [operator_endpoint.removeprefix("http://")],
                        "labels": {"namespace": "kvserve-system", "pod": "kvs-kvserve-operator-0"},
                    }
                ],
            },
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = _free_port()
    log = tmp / "prometheus.log"
    cmd = [
        "timeout",
        str(PROCESS_LIMIT_S),
        exe,
        f"--config.file={tmp / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_http(base + "/-/ready", proc, log, 60)
        yield base, docs
    finally:
        _stop(proc)
        shutil.rmtree(tmp / "data", ignore_errors=True)


def _query(prom: str, expr: str, at: float | None = None) -> list[dict]:
    params = {"query": expr} | ({"time": f"{at:.3f}"} if at is not None else {})
    body = httpx.get(prom + "/api/v1/query", params=params, timeout=10).json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _scalar(result: list[dict]) -> float | None:
    assert len(result) <= 1, result
    return float(result[0]["value"][1]) if result else None


def test_adapter_and_keda_queries_return_the_queue_depth(prometheus, serve):
    prom, docs = prometheus
    adapter_cfg = next(d for d in docs if d["kind"] == "ConfigMap" and "config.yaml" in d.get("data", {}))
    (rule,) = yaml.safe_load(adapter_cfg["data"]["config.yaml"])["rules"]
    (trigger,) = next(d for d in docs if d["kind"] == "ScaledObject")["spec"]["triggers"]
    keda_query = trigger["metadata"]["query"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # both targets scraped at least twice
        up = {r["metric"]["job"]: r["value"][1] for r in _query(prom, "up")}
        if len(up) == 2 and set(up.values()) == {"1"} and _query(prom, "count_over_time(up[10s]) >= 2"):
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"targets not up: {up}")

    # The adapter's discovery: seriesQuery finds the engine's series with the labels it maps to resources.
    series = httpx.get(prom + "/api/v1/series", params={"match[]": rule["seriesQuery"]}, timeout=10).json()["data"]
    assert [(s["namespace"], s["pod"]) for s in series] == [(NAMESPACE, POD)]
    # ... then its metricsQuery, expanded the way the adapter expands it for GET pods/*/vllm_num_requests_waiting.
    adapter_query = (
        rule["metricsQuery"]
        .replace("<<.Series>>", rule["name"]["matches"].strip("^$"))
        .replace("<<.LabelMatchers>>", f'namespace="{NAMESPACE}",pod=~"{POD}"')
        .replace("<<.GroupBy>>", "pod")
    )

    raw_query = f'vllm:num_requests_waiting{{namespace="{NAMESPACE}",pod="{POD}"}}'

    async def load_and_watch() -> tuple[list[float], list[tuple[float, ...]], list[int]]:
        """Keep NUM_REQUESTS in the server (2 run, the rest wait) until Prometheus has reported a queue, then
        let them finish; at most MAX_REQUESTS in all. Polls /metrics and the three queries meanwhile."""
        seen_in_metrics: list[float] = []
        seen_in_prometheus: list[tuple[float, ...]] = []
        started = time.monotonic()
        async with (
            httpx.AsyncClient(base_url=serve, timeout=120) as client,
            httpx.AsyncClient(timeout=10) as prom_client,
        ):
            tasks: list[asyncio.Future] = []
            while True:
                queue_seen = any(v[0] >= 1 for v in seen_in_prometheus)
                if not queue_seen and time.monotonic() - started < 60 and len(tasks) < MAX_REQUESTS:
                    outstanding = sum(not t.done() for t in tasks)
                    tasks += [
                        asyncio.ensure_future(_completion(client, f"load {len(tasks) + i}", MAX_TOKENS))
                        for i in range(NUM_REQUESTS - outstanding)
                    ]
                elif all(t.done() for t in tasks):
                    break
                text = (await client.get("/metrics")).text
                seen_in_metrics += [
                    float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines()
                    if line.startswith("vllm:num_requests_waiting{")
                ]
                # Evaluate a few seconds in the past: a scrape's samples carry its start time but land when it
                # ends, so at `now` one query can see a sample that the query before it did not.
                at = time.time() - SETTLED_S
                values = []
                for query in (adapter_query, keda_query, raw_query):
                    body = (
                        await prom_client.get(prom + "/api/v1/query", params={"query": query, "time": f"{at:.3f}"})
                    ).json()
                    assert body["status"] == "success", body
                    values.append(_scalar(body["data"]["result"]))
                if values[0] is not None:
                    seen_in_prometheus.append(tuple(values))
                await asyncio.sleep(0.1)
            return seen_in_metrics, seen_in_prometheus, [t.result().status_code for t in tasks]

    seen_in_metrics, seen_in_prometheus, codes = asyncio.run(asyncio.wait_for(load_and_watch(), timeout=200))
    assert codes == [200] * len(codes)
    assert max(seen_in_metrics) >= 2, seen_in_metrics  # the load really queued
    # One pod: the adapter's per-pod value, the KEDA sum and the raw gauge agree at every evaluation time.
    assert all(len(set(v)) == 1 for v in seen_in_prometheus), seen_in_prometheus
    adapter_values = [v[0] for v in seen_in_prometheus]
    assert 1 <= max(adapter_values) <= NUM_REQUESTS - 1, seen_in_prometheus  # 1 seat at least is running

    deadline = time.monotonic() + 20  # drained: the next scrapes bring both back to 0
    while time.monotonic() < deadline:
        if _scalar(_query(prom, adapter_query)) == 0 and _scalar(_query(prom, keda_query)) == 0:
            break
        time.sleep(0.5)
    else:
        raise AssertionError((_query(prom, adapter_query), _query(prom, keda_query)))


def test_rules_evaluate_cleanly_and_every_panel_has_data(prometheus):
    prom, _ = prometheus
    time.sleep(3)  # a few evaluation rounds after the load test
    groups = httpx.get(prom + "/api/v1/rules", timeout=10).json()["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == len(rule_exprs(prometheus_rule_groups(render_chart("monitoring.prometheusRule.enabled=true"))))
    assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
    # Recording rules joined engine series with the labels the PodMonitor gives.
    (requests,) = _query(prom, f'kvserve:requests:rate1h{{inferenceservice="{NAME}"}}')
    assert requests["metric"]["namespace"] == NAMESPACE and float(requests["value"][1]) > 0
    # honor_labels kept the InferenceService's namespace on the operator's series.
    (planned,) = _query(prom, "kvserve_inferenceservice_plan_kv_tokens")
    assert planned["metric"]["namespace"] == NAMESPACE and planned["metric"]["inferenceservice"] == NAME

    empty_panels = []
    for panel in dashboard()["panels"]:
        targets = panel.get("targets", [])
        if targets and not any(_query(prom, substitute(t["expr"])) for t in targets):
            empty_panels.append(panel["title"])
    assert empty_panels == [], "panels with no data against a live kvserve serve + operator"
    for name, selector in variable_selectors():
        assert _query(prom, substitute(selector)), name

"""The chart's monitoring objects, rendered by the real helm: valid objects, rules that promtool accepts and
whose unit tests fire and stay quiet, a runbook section per alert, and a dashboard whose every query parses."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from kvserve.operator import labels, render
from kvserve.operator import spec as spec_mod
from tests.monitoring.promql import (
    DASHBOARD,
    MONITORING_ON,
    ROOT,
    binary,
    dashboard,
    dashboard_targets,
    metric_names,
    prometheus_rule_groups,
    render_chart,
    rule_exprs,
    substitute,
    variable_selectors,
)
from tests.operator.test_helm_chart import CHART, K8S_VERSION, _find_helm, _run

HERE = pathlib.Path(__file__).resolve().parent
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return render_chart(*MONITORING_ON, "monitoring.labels.release=kube-prometheus-stack")


def _one(docs: list[dict], kind: str, name_suffix: str = "") -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    return doc


def test_monitoring_is_off_by_default():
    kinds = {d["kind"] for d in render_chart()}
    assert not kinds & {"PodMonitor", "ServiceMonitor", "PrometheusRule"}
    assert not [d for d in render_chart() if d["kind"] == "ConfigMap" and "dashboard" in d["metadata"]["name"]]


def test_helm_lint_strict_with_monitoring_on():
    args = ["lint", "--strict", str(CHART)]
    for s in MONITORING_ON:
        args += ["--set", s]
    assert "0 chart(s) failed" in _run(_find_helm(), *args)


def test_rendered_objects_are_valid(docs):
    kinds = sorted(d["kind"] for d in docs)
    for kind in ("PodMonitor", "ServiceMonitor", "PrometheusRule", "Service"):
        assert kind in kinds, kinds
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            # No upstream schema offline for Prometheus Operator CRDs: the fields their CRDs require.
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            assert doc["metadata"]["labels"]["release"] == "kube-prometheus-stack"
            assert {
                "PodMonitor": {"selector", "podMetricsEndpoints"},
                "ServiceMonitor": {"selector", "endpoints"},
                "PrometheusRule": {"groups"},
            }[doc["kind"]] <= set(doc["spec"])
        elif doc["kind"] != "ScaledObject":
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    groups = [g["name"] for g in _one(docs, "PrometheusRule")["spec"]["groups"]]
    assert len(groups) == len(set(groups))  # spec.groups is a list-map keyed by name


def test_podmonitor_selects_the_operators_engine_pods_and_labels_them(docs):
    pm = _one(docs, "PodMonitor")
    resolved = spec_mod.resolve(yaml.safe_load((ROOT / "examples" / "llama70b.yaml").read_text())["spec"])
    dep = render.deployment(resolved, "llama70b", "ml")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    container_ports = {p["name"] for p in dep["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert endpoint["port"] in container_ports and endpoint["path"] == "/metrics"
    (relabel,) = endpoint["relabelings"]
    # Kubernetes SD turns the pod label serving.kvserve.dev/inferenceservice into this meta label.
    assert relabel["sourceLabels"] == [
        "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", labels.OWNER_LABEL)
    ]
    assert relabel["targetLabel"] == "inferenceservice" and pod_labels[labels.OWNER_LABEL] == "llama70b"
    assert pm["spec"]["namespaceSelector"] == {"any": True}


def test_servicemonitor_reaches_the_operators_metrics_port(docs):
    sm, svc, dep = _one(docs, "ServiceMonitor"), _one(docs, "Service", "-metrics"), _one(docs, "Deployment")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True  # keeps the InferenceService's namespace label
    (port,) = svc["spec"]["ports"]
    assert endpoint["port"] == port["name"]
    pod = dep["spec"]["template"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[port["targetPort"]] == port["port"]
    assert f"--metrics-port={port['port']}" in container["command"]


def test_dashboard_configmap_for_grafanas_sidecar(docs):
    cm = _one(docs, "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["kvserve.json"]) == dashboard()
    assert len(cm["data"]["kvserve.json"]) < 256 * 1024  # client-side apply's last-applied annotation limit
    board = dashboard()
    assert board["id"] is None and 8 <= len(board["uid"]) <= 40
    assert "__inputs" not in board and "DS_PROMETHEUS" not in DASHBOARD.read_text()
    panel_ids = [p["id"] for p in board["panels"]]
    assert len(panel_ids) == len(set(panel_ids))


def test_dashboard_json_is_generated():
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "grafana_dashboard.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_promtool_checks_the_rendered_rules(docs, tmp_path):
    promtool = binary("promtool")
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(prometheus_rule_groups(docs)))
    check = subprocess.run(
        [promtool, "check", "rules", "--lint-fatal", str(rules)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS" in check.stdout


def test_every_alert_fires_and_stays_quiet_in_promtool_unit_tests(tmp_path):
    """tests/monitoring/alerts_test.yaml against the rules rendered with default values; every alert of the
    chart must appear there with a case that fires (and the file holds the quiet cases)."""
    promtool = binary("promtool")
    groups = prometheus_rule_groups(render_chart("monitoring.prometheusRule.enabled=true"))
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(groups))
    shutil.copy(HERE / "alerts_test.yaml", tmp_path / "alerts_test.yaml")
    result = subprocess.run(
        [promtool, "test", "rules", "alerts_test.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    alerts = {r["alert"] for g in groups["groups"] for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load((HERE / "alerts_test.yaml").read_text())["tests"]
    firing = {case["alertname"] for t in tests for case in t.get("alert_rule_test", []) if case.get("exp_alerts")}
    quiet = {case["alertname"] for t in tests for case in t.get("alert_rule_test", []) if not case.get("exp_alerts")}
    assert alerts == firing, f"alerts without a firing test: {alerts - firing}"
    assert alerts == quiet | firing and quiet, f"alerts without a quiet case: {alerts - quiet}"


def test_every_alert_has_a_runbook_section(docs):
    doc = (ROOT / "docs" / "observability.md").read_text()
    headings = {h.strip().lower() for h in re.findall(r"^#{2,4} (.+)$", doc, re.M)}
    for group in _one(docs, "PrometheusRule")["spec"]["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                assert rule["alert"].lower() in headings, f"docs/observability.md has no section {rule['alert']}"
                assert rule["annotations"]["runbook_url"].endswith("#" + rule["alert"].lower())
                assert {"summary", "description"} <= set(rule["annotations"])
                assert rule["labels"]["severity"] in ("critical", "warning", "info")


def test_every_dashboard_query_parses(tmp_path):
    """promtool parses each query (Grafana variables substituted) as a recording rule's expression."""
    promtool = binary("promtool")
    exprs = [substitute(e) for _, e in dashboard_targets()] + [substitute(s) for _, s in variable_selectors()]
    rules = {
        "groups": [
            {"name": "dashboard", "rules": [{"record": f"dashboard:query{i}", "expr": e} for i, e in enumerate(exprs)]}
        ]
    }
    (tmp_path / "dashboard.yaml").write_text(yaml.safe_dump(rules))
    result = subprocess.run(
        [promtool, "check", "rules", str(tmp_path / "dashboard.yaml")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # Control: the same check rejects a broken query, so a pass above means something.
    (tmp_path / "broken.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": "x", "rules": [{"record": "x:y", "expr": "sum by (le (rate(x[1m]))"}]}]})
    )
    assert (
        subprocess.run(
            [promtool, "check", "rules", str(tmp_path / "broken.yaml")], capture_output=True, timeout=60
        ).returncode
        != 0
    )


def test_metric_name_extraction():
    assert metric_names(
        'histogram_quantile(0.99, sum by (le, namespace) (rate(a:b_bucket{x=~"$n",le="1.0"}[1m])))'
    ) == {"a:b_bucket"}
    assert metric_names("max by (ns) (x_total) * on (ns) group_left(foo) y > 1e3 and on (ns) z offset 5m") == {
        "x_total",
        "y",
        "z",
    }
    assert metric_names("up == 0 unless on (pod) (kvserve:draining == 1)") == {"up", "kvserve:draining"}
    assert all(metric_names(substitute(e)) for _, e in dashboard_targets())
    assert all(
        metric_names(e)
        for _, e in rule_exprs(prometheus_rule_groups(render_chart("monitoring.prometheusRule.enabled=true")))
    )

"""Helpers for the monitoring tests: the chart's monitoring objects rendered by the real helm, the dashboard's
and rules' PromQL, the metric names an expression reads, and the Prometheus binaries (Debian's `prometheus`
package; .ci/run installs it, tests skip with that reason when it is absent)."""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import pytest
import yaml

from tests.operator.test_helm_chart import CHART, _find_helm, _run

ROOT = pathlib.Path(__file__).resolve().parents[2]
DASHBOARD = CHART / "dashboards" / "kvserve.json"
MONITORING_ON = (
    "monitoring.podMonitor.enabled=true",
    "monitoring.serviceMonitor.enabled=true",
    "monitoring.prometheusRule.enabled=true",
    "monitoring.grafanaDashboard.enabled=true",
)
# Grafana's variables, replaced the way Grafana would before the query reaches Prometheus.
GRAFANA_VARS = {"$__rate_interval": "1m", "$namespace": ".*", "$inferenceservice": ".*"}

_KEYWORDS = {
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "inf",
    "nan",
    "Inf",
    "NaN",
}


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(
            f"`{name}` not found: install Debian's `prometheus` package (apt-get install prometheus; "
            ".ci/run does this in CI)"
        )
    return path


def render_chart(*sets: str) -> list[dict]:
    args = ["template", "kvs", str(CHART), "--namespace", "kvserve-system", "--include-crds"]
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(_run(_find_helm(), *args)) if d]


def prometheus_rule_groups(docs: list[dict]) -> dict:
    """The PrometheusRule's spec: a plain Prometheus rule file (promtool rejects the CRD wrapper)."""
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    return rule["spec"]


def rule_exprs(groups: dict) -> list[tuple[str, str]]:
    return [(r.get("alert") or r["record"], str(r["expr"])) for g in groups["groups"] for r in g["rules"]]


def recorded_names(groups: dict) -> set[str]:
    return {r["record"] for g in groups["groups"] for r in g["rules"] if "record" in r}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_targets() -> list[tuple[str, str]]:
    """(panel title, expr) for every query of every panel."""
    out = []
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    return out


def variable_selectors() -> list[tuple[str, str]]:
    """label_values(<selector>, <label>) variables -> (variable name, selector)."""
    out = []
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", var["query"]["query"])
            assert match, var["query"]
            out.append((var["name"], match.group(1)))
    return out


def substitute(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unsubstituted Grafana variable in {expr!r}"
    return expr


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects. Strings, label matchers, range/subquery brackets, grouping label
    lists and numbers are removed first; then an identifier is a metric unless a `(` follows it (a function or
    aggregation) or it is a keyword."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"\{[^{}]*\}", " ", s)
    s = re.sub(r"\[[^\[\]]*\]", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", s)
    s = re.sub(r"\boffset\s+-?[0-9smhdwy]+", " ", s)
    s = re.sub(r"(?<![\w:])\d+(\.\d+)?([eE][+-]?\d+)?", " ", s)
    names = set()
    for match in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", s):
        if s[match.end() :].lstrip().startswith("(") or match.group(0) in _KEYWORDS:
            continue
        names.add(match.group(0))
    return names


def exposed_sample_names(text: str) -> set[str]:
    """Sample names of a /metrics exposition (counters with _total, histograms with _bucket/_sum/_count)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}

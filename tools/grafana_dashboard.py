"""Generate charts/kvserve/dashboards/kvserve.json, the Grafana dashboard the chart ships.

    python tools/grafana_dashboard.py            # rewrite the JSON
    python tools/grafana_dashboard.py --check    # exit 1 if the JSON is not what this script generates

One dashboard per fleet, filtered by the `namespace` and `inferenceservice` variables. Engine series carry
`inferenceservice` from the chart's PodMonitor; the kvserve_inferenceservice_* series come from the operator
(ServiceMonitor, honorLabels). Classic dashboard JSON with a real `datasource` variable, no `__inputs`, so the
Grafana sidecar can provision it as is. tests/monitoring checks that every expression parses (promtool) and
names only metrics that a live `kvserve serve` or the operator exports.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

OUT = pathlib.Path(__file__).resolve().parents[1] / "charts" / "kvserve" / "dashboards" / "kvserve.json"
UID = "kvserve-inference-services"
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'namespace=~"$namespace", inferenceservice=~"$inferenceservice"'
BY = "namespace, inferenceservice"
RATE = "$__rate_interval"


def q(expr: str, legend: str) -> dict[str, str]:
    return {"expr": expr, "legendFormat": legend}


def quantiles(metric: str) -> list[dict[str, str]]:
    """p50/p95/p99 per InferenceService, summed over pods by `le` first (per-series quantiles mislead)."""
    return [
        q(
            f"histogram_quantile({p}, sum by (le, {BY}) (rate({metric}_bucket{{{SEL}}}[{RATE}])))",
            f"{{{{inferenceservice}}}} p{int(p * 100)}",
        )
        for p in (0.5, 0.95, 0.99)
    ]


PANELS: list[tuple[str, list[tuple[str, str, str, list[dict[str, str]]]]]] = [
    # (row title, [(panel type, title, unit, targets)])
    (
        "Load and autoscaling",
        [
            (
                "timeseries",
                "Queue depth per pod vs HPA target",
                "short",
                [
                    q(f"avg by ({BY}) (vllm:num_requests_waiting{{{SEL}}})", "{{inferenceservice}} waiting per pod"),
                    q(
                        f"max by ({BY}) (kvserve_inferenceservice_autoscaling_target_queue_depth{{{SEL}}})",
                        "{{inferenceservice}} target",
                    ),
                ],
            ),
            (
                "timeseries",
                "Running requests vs planned concurrency",
                "short",
                [
                    q(f"sum by ({BY}) (vllm:num_requests_running{{{SEL}}})", "{{inferenceservice}} running"),
                    q(
                        f"max by ({BY}) (kvserve_inferenceservice_plan_max_concurrency{{{SEL}}})"
                        f" * on ({BY}) max by ({BY}) (kvserve_inferenceservice_ready_replicas{{{SEL}}})",
                        "{{inferenceservice}} planned (max concurrency x ready replicas)",
                    ),
                ],
            ),
            (
                "timeseries",
                "Replicas: desired, ready, max",
                "short",
                [
                    q(
                        f"max by ({BY}) (kvserve_inferenceservice_desired_replicas{{{SEL}}})",
                        "{{inferenceservice}} desired",
                    ),
                    q(
                        f"max by ({BY}) (kvserve_inferenceservice_ready_replicas{{{SEL}}})",
                        "{{inferenceservice}} ready",
                    ),
                    q(
                        f"max by ({BY}) (kvserve_inferenceservice_autoscaling_max_replicas{{{SEL}}})",
                        "{{inferenceservice}} HPA max",
                    ),
                    q(f"sum by ({BY}) (up{{{SEL}}})", "{{inferenceservice}} engines scraped"),
                ],
            ),
        ],
    ),
    (
        "KV cache",
        [
            (
                "timeseries",
                "KV used vs plan (tokens per replica)",
                "short",
                [
                    q(
                        f"max by ({BY}, pod) (vllm:kv_cache_usage_perc{{{SEL}}} * kvserve:kv_capacity_tokens{{{SEL}}})",
                        "{{pod}} used",
                    ),
                    q(f"max by ({BY}, pod) (kvserve:kv_capacity_tokens{{{SEL}}})", "{{pod}} capacity"),
                    q(
                        f"max by ({BY}) (kvserve_inferenceservice_plan_kv_tokens{{{SEL}}})",
                        "{{inferenceservice}} planned",
                    ),
                ],
            ),
            (
                "timeseries",
                "KV-cache usage",
                "percentunit",
                [
                    q(f"max by ({BY}, pod) (vllm:kv_cache_usage_perc{{{SEL}}})", "{{pod}}"),
                ],
            ),
            (
                "timeseries",
                "Prefix-cache hit rate",
                "percentunit",
                [
                    q(
                        f"sum by ({BY}) (rate(vllm:prefix_cache_hits_total{{{SEL}}}[{RATE}]))"
                        f" / (sum by ({BY}) (rate(vllm:prefix_cache_queries_total{{{SEL}}}[{RATE}])) > 0)",
                        "{{inferenceservice}}",
                    ),
                ],
            ),
            (
                "timeseries",
                "Preemptions per second",
                "short",
                [
                    q(f"sum by ({BY}) (rate(vllm:num_preemptions_total{{{SEL}}}[{RATE}]))", "{{inferenceservice}}"),
                ],
            ),
        ],
    ),
    (
        "Latency",
        [
            ("timeseries", "Time to first token", "s", quantiles("vllm:time_to_first_token_seconds")),
            ("timeseries", "Inter-token latency", "s", quantiles("vllm:inter_token_latency_seconds")),
            ("timeseries", "End-to-end request latency", "s", quantiles("vllm:e2e_request_latency_seconds")),
            (
                "timeseries",
                "Mean time per phase (queue, prefill, decode)",
                "s",
                [
                    q(
                        f"sum by ({BY}) (rate(vllm:request_{phase}_time_seconds_sum{{{SEL}}}[{RATE}]))"
                        f" / (sum by ({BY}) (rate(vllm:request_{phase}_time_seconds_count{{{SEL}}}[{RATE}])) > 0)",
                        f"{{{{inferenceservice}}}} {phase}",
                    )
                    for phase in ("queue", "prefill", "decode")
                ],
            ),
        ],
    ),
    (
        "Throughput and errors",
        [
            (
                "timeseries",
                "Tokens per second",
                "short",
                [
                    q(
                        f"sum by ({BY}) (rate(vllm:prompt_tokens_total{{{SEL}}}[{RATE}]))",
                        "{{inferenceservice}} prompt",
                    ),
                    q(
                        f"sum by ({BY}) (rate(vllm:generation_tokens_total{{{SEL}}}[{RATE}]))",
                        "{{inferenceservice}} generation",
                    ),
                ],
            ),
            (
                "timeseries",
                "Finished requests by reason",
                "reqps",
                [
                    q(
                        f"sum by ({BY}, finished_reason) (rate(vllm:request_success_total{{{SEL}}}[{RATE}]))",
                        "{{inferenceservice}} {{finished_reason}}",
                    ),
                ],
            ),
            (
                "timeseries",
                "Rejected before the engine (429 queue full, 503, 401)",
                "reqps",
                [
                    q(
                        f"sum by ({BY}, reason) (rate(kvserve:http_requests_rejected_total{{{SEL}}}[{RATE}]))",
                        "{{inferenceservice}} {{reason}}",
                    ),
                ],
            ),
        ],
    ),
    (
        "Capacity plan and operator",
        [
            (
                "table",
                "Capacity plan",
                "short",
                [
                    q(f"max by ({BY}) (kvserve_inferenceservice_plan_kv_tokens{{{SEL}}})", "KV tokens"),
                    q(f"max by ({BY}) (kvserve_inferenceservice_plan_max_concurrency{{{SEL}}})", "max concurrency"),
                    q(f"max by ({BY}) (kvserve_inferenceservice_plan_num_blocks_per_gpu{{{SEL}}})", "blocks per GPU"),
                    q(
                        f"max by ({BY}) (kvserve_inferenceservice_plan_kv_cache_bytes_per_gpu{{{SEL}}})",
                        "KV bytes per GPU",
                    ),
                ],
            ),
            (
                "table",
                "Conditions (1 = current status)",
                "short",
                [
                    q(f"max by ({BY}, type, status) (kvserve_inferenceservice_condition{{{SEL}}}) == 1", "{{type}}"),
                ],
            ),
            (
                "timeseries",
                "Operator reconciles",
                "short",
                [
                    q(
                        f"sum by (trigger, result) (rate(kvserve_operator_reconciles_total[{RATE}]))",
                        "{{trigger}} {{result}}",
                    ),
                    q(
                        f"histogram_quantile(0.99, sum by (le) (rate(kvserve_operator_reconcile_duration_seconds_bucket"
                        f"[{RATE}])))",
                        "p99 duration (s)",
                    ),
                ],
            ),
        ],
    ),
]


def _panel(
    panel_id: int, kind: str, title: str, unit: str, targets: list[dict[str, str]], x: int, y: int, width: int
) -> dict[str, Any]:
    panel: dict[str, Any] = {
        "id": panel_id,
        "type": kind,
        "title": title,
        "datasource": DS,
        "gridPos": {"h": 8, "w": width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [{**t, "refId": chr(ord("A") + i), "datasource": DS} for i, t in enumerate(targets)],
    }
    if kind == "table":  # one row per InferenceService, one column per query
        panel["targets"] = [{**t, "instant": True, "format": "table"} for t in panel["targets"]]
        panel["transformations"] = [{"id": "merge", "options": {}}]
    else:
        panel["options"] = {
            "legend": {"displayMode": "list", "placement": "bottom"},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    return panel


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": f"{name}-var"},
        "definition": query,
        "refresh": 2,
        "multi": True,
        "includeAll": True,
        "current": {"selected": True, "text": "All", "value": "$__all"},
        "sort": 1,
    }


def build() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y, panel_id = 0, 1
    for row_title, row_panels in PANELS:
        panels.append(
            {
                "id": panel_id,
                "type": "row",
                "title": row_title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        panel_id, y = panel_id + 1, y + 1
        width = 24 // min(len(row_panels), 3)
        for i, (kind, title, unit, targets) in enumerate(row_panels):
            x = (i % 3) * width
            if i and i % 3 == 0:
                y += 8
            panels.append(_panel(panel_id, kind, title, unit, targets, x, y, width))
            panel_id += 1
        y += 8
    return {
        "id": None,
        "uid": UID,
        "title": "kvserve / InferenceServices",
        "tags": ["kvserve", "vllm"],
        "description": "Queue, KV cache vs capacity plan, latency, throughput and the operator, per InferenceService.",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "timezone": "browser",
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                    "refresh": 1,
                },
                _variable("namespace", "Namespace", "label_values(vllm:num_requests_running, namespace)"),
                _variable(
                    "inferenceservice",
                    "InferenceService",
                    'label_values(vllm:num_requests_running{namespace=~"$namespace"}, inferenceservice)',
                ),
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed JSON is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python tools/grafana_dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

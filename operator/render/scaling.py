"""Pure renderers for scale from zero and the Gateway API Inference Extension.

`spec.autoscaling.minReplicas: 0` renders a KEDA `ScaledObject` (keda.sh/v1alpha1) instead of the HPA:
an HPA cannot go below 1 replica without the HPAScaleToZero feature gate, so KEDA activates the workload
(0 -> 1) itself and owns the HPA that scales 1 -> N (`keda-hpa-<name>`); a second HPA on the same target
would fight it. Its triggers, all Prometheus queries over this InferenceService's pods:
  - held-requests: the router's `kvserve_router:held_requests` (requests waiting for a replica: the only
    demand visible at zero replicas, since nothing else is running to report a queue);
  - queue-depth: the replicas' `vllm:num_requests_waiting`, the same target the HPA uses;
  - running-requests: `vllm:num_requests_running`, so a replica still streaming answers is not idle
    (its threshold, a full replica's maxNumSeqs, makes it a brake on scale-to-zero, not a scaling signal).
KEDA scales to zero once every trigger has been at or below its activation threshold (0) for
`cooldownPeriod` (spec.autoscaling.idlePeriodSeconds).

`spec.gateway.inferencePool` renders a GIE `InferencePool` (inference.networking.k8s.io/v1) selecting the
engine pods on the API port, with the endpoint picker reference exactly as the user gave it.
"""

from __future__ import annotations

import re
from typing import Any

from kvserve.operator.labels import engine_labels, engine_pod_selector
from kvserve.operator.spec import API_VERSION, KIND, Resolved

DEFAULT_IDLE_PERIOD_SECONDS = 300  # KEDA's own cooldownPeriod default
DEFAULT_PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"  # the chart's keda.prometheusAddress
POLLING_INTERVAL_SECONDS = 10  # how often KEDA checks activation: the worst extra delay of a cold start
HELD_METRIC = "kvserve_router:held_requests"


def _pods(name: str) -> str:
    """PromQL regex for the pods of Deployment `name` (<name>-<replicaset hash>-<pod hash>): the router's
    (<name>-router-...) and another InferenceService's (<name>-x-...) have one dash-separated part more."""
    # A Kubernetes name is [a-z0-9.-]: only "." is a regex metacharacter, written as a class because a
    # backslash would also need escaping inside PromQL's double-quoted string (and re.escape's "\-" is not
    # a valid PromQL escape at all).
    assert re.fullmatch(r"[a-z0-9.-]+", name), name
    return name.replace(".", "[.]") + "-[a-z0-9]+-[a-z0-9]+"


def _prometheus(name: str, address: str, query: str, threshold: int) -> dict[str, Any]:
    return {
        "type": "prometheus",
        "name": name,
        "metricType": "AverageValue",
        "metadata": {
            "serverAddress": address,
            "query": query,
            "threshold": str(threshold),
            # Any demand at all wakes a model at zero replicas.
            "activationThreshold": "0",
            # No series (no pod to scrape at zero replicas) counts as 0, not as an error.
            "ignoreNullValues": "true",
        },
    }


def scaled_object(
    resolved: Resolved, name: str, namespace: str, behavior: dict, target: dict | None = None, pods: str | None = None
) -> dict:
    """`target` / `pods`: the scaled object and the PromQL regex of its serving pods (default this
    InferenceService's /scale and its Deployment's pods; a LeaderWorkerSet's /scale and leaders for groups)."""
    spec = resolved.spec
    auto = spec.autoscaling
    address = auto.prometheus_address or DEFAULT_PROMETHEUS
    max_replicas, queue_depth = resolved.autoscaling["maxReplicas"], resolved.autoscaling["targetQueueDepth"]
    where = f'namespace="{namespace}",pod=~"{pods or _pods(name)}"'
    router_where = f'namespace="{namespace}",pod=~"{_pods(name + "-router")}"'
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": name, "namespace": namespace, "labels": engine_labels(name)},
        "spec": {
            # Like the HPA: KEDA scales the InferenceService through its /scale subresource and the operator
            # rolls the count into the Deployment.
            "scaleTargetRef": target or {"apiVersion": API_VERSION, "kind": KIND, "name": name},
            "minReplicaCount": 0,
            "maxReplicaCount": max_replicas,
            "pollingInterval": POLLING_INTERVAL_SECONDS,
            "cooldownPeriod": auto.idle_period_seconds
            if auto.idle_period_seconds is not None
            else DEFAULT_IDLE_PERIOD_SECONDS,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": behavior}},
            "triggers": [
                _prometheus("held-requests", address, f"sum({HELD_METRIC}{{{router_where}}})", queue_depth),
                _prometheus("queue-depth", address, f"sum(vllm:num_requests_waiting{{{where}}})", queue_depth),
                _prometheus(
                    "running-requests",
                    address,
                    f"sum(vllm:num_requests_running{{{where}}})",
                    spec.engine.max_num_seqs,
                ),
            ],
        },
    }


def inference_pool(
    resolved: Resolved, name: str, namespace: str, selector: dict[str, str] | None = None
) -> dict | None:
    pool = resolved.spec.gateway.inference_pool if resolved.spec.gateway is not None else None
    if pool is None:
        return None
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": namespace, "labels": engine_labels(name)},
        "spec": {
            # The engine pods only: the router's pods share the instance label but not the component.
            "selector": {"matchLabels": selector or engine_pod_selector(name)},
            "targetPorts": [{"number": resolved.spec.port}],
            "endpointPickerRef": pool.endpoint_picker_ref.model_dump(by_alias=True, exclude_none=True),
        },
    }

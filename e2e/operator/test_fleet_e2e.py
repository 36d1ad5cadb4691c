"""spec.slo + spec.workload through the running operator (issue 25): kopf with kvserve's handlers against kmock's
KubernetesEmulator (conftest.py). The reconcile writes status.fleet, renders the HPA with the planned bounds and
exports them as the operator's autoscaling gauges; an explicit spec.autoscaling value wins over the plan."""

from __future__ import annotations

import copy

import pytest
from kopf.testing import KopfRunner

from kvserve.operator import metrics as operator_metrics
from kvserve.operator import spec as spec_mod

NS, NAME = "default", "chat"
pytestmark = pytest.mark.timeout(90)

BODY = {
    "apiVersion": spec_mod.API_VERSION,
    "kind": spec_mod.KIND,
    "metadata": {"name": NAME, "namespace": NS, "uid": "uid-chat", "generation": 1, "resourceVersion": "1"},
    "spec": {
        "model": {"uri": "pvc://models/llama-3-8b", "name": "llama-3-8b"},
        "gpu": {"product": "h100-80gb"},
        "autoscaling": {"enabled": True},  # no bounds written: the plan's apply
        "slo": {"ttftP90Seconds": 1.0, "tpotP99Seconds": 0.05},
        "workload": {"requestRate": 100, "minRequestRate": 40, "promptLen": 512, "outputLen": 64},
    },
}


def _gauge(suffix: str) -> float | None:
    return operator_metrics.REGISTRY.get_sample_value(
        f"kvserve_inferenceservice_{suffix}", {"namespace": NS, "inferenceservice": NAME}
    )


def test_status_fleet_hpa_and_gauges_follow_the_plan_and_an_explicit_value_wins(emulator):
    planned = spec_mod.resolve(BODY["spec"]).fleet
    assert planned is not None and planned.hpa is not None
    h = planned.hpa
    hpa_path = emulator.CHILDREN["HorizontalPodAutoscaler"]
    with KopfRunner(["run", "--standalone", "--all-namespaces", "-m", "kvserve.operator.handlers"], timeout=30) as r:
        emulator.call("POST", emulator.path(emulator.CR, NS), copy.deepcopy(BODY))
        fleet = emulator.wait_for(
            lambda: ((emulator.get(emulator.CR, NS, NAME) or {}).get("status") or {}).get("fleet"),
            what="status.fleet",
        )
        assert fleet["feasible"] and (fleet["minReplicas"], fleet["maxReplicas"]) == (h.min_replicas, h.max_replicas)
        assert fleet["targetQueueDepth"] == h.target_queue_depth
        assert fleet["replicaRequestsPerSecond"] == pytest.approx(planned.replica_requests_per_s, abs=1e-3)
        hpa = emulator.wait_for(lambda: emulator.get(hpa_path, NS, NAME), what="the HPA")["spec"]
        assert (hpa["minReplicas"], hpa["maxReplicas"]) == (h.min_replicas, h.max_replicas)
        assert hpa["metrics"][0]["pods"]["target"]["averageValue"] == str(h.target_queue_depth)
        assert (_gauge("autoscaling_min_replicas"), _gauge("autoscaling_max_replicas")) == (
            h.min_replicas,
            h.max_replicas,
        )
        assert _gauge("autoscaling_target_queue_depth") == h.target_queue_depth

        # The user writes a queue-depth target: it wins, the planned replica bounds stay.
        explicit = h.target_queue_depth + 7
        emulator.call(
            "PATCH",
            emulator.path(emulator.CR, NS, NAME),
            {"metadata": {"generation": 2}, "spec": {"autoscaling": {"targetQueueDepth": explicit}}},
            content_type="application/merge-patch+json",
        )
        emulator.wait_for(
            lambda: (
                emulator.get(hpa_path, NS, NAME)["spec"]["metrics"][0]["pods"]["target"]["averageValue"]
                == str(explicit)
            ),
            what="the explicit target in the HPA",
        )
        assert (emulator.get(hpa_path, NS, NAME)["spec"]["maxReplicas"]) == h.max_replicas
        emulator.wait_for(lambda: _gauge("autoscaling_target_queue_depth") == explicit, what="the gauge")
    assert r.exit_code == 0 and r.exception is None and "Traceback" not in r.output, r.output[-3000:]

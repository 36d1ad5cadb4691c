"""Issue 44: the operator's reconcile never blocks on an SLO plan. kopf with kvserve's handlers against kmock's
KubernetesEmulator (conftest.py): the plan is held on purpose until the test has seen the reconcile finish
(status.fleet says planning, the HPA has spec.autoscaling's bounds); released, the plan's end reconciles again
and the planned bounds land without any change to the InferenceService."""

from __future__ import annotations

import copy
import threading

import pytest
from kopf.testing import KopfRunner

from kvserve.operator import fleet
from kvserve.operator import spec as spec_mod

NS, NAME = "default", "slow-plan"
pytestmark = pytest.mark.timeout(120)

BODY = {
    "apiVersion": spec_mod.API_VERSION,
    "kind": spec_mod.KIND,
    "metadata": {"name": NAME, "namespace": NS, "uid": "uid-slow-plan", "generation": 1, "resourceVersion": "1"},
    "spec": {
        "model": {"uri": "pvc://models/llama-3-8b", "name": "llama-3-8b"},
        "gpu": {"product": "h100-80gb"},
        "autoscaling": {"enabled": True},
        "slo": {"ttftP90Seconds": 1.0, "tpotP99Seconds": 0.05},
        # a rate no other test plans, so the plan cache has no answer yet
        "workload": {"requestRate": 77, "minRequestRate": 20, "promptLen": 384, "outputLen": 48},
    },
}


def test_the_reconcile_writes_planning_while_the_plan_runs_then_the_plan(emulator, monkeypatch):
    release = threading.Event()
    real = fleet.evaluate

    def held(*args, **kwargs):
        assert release.wait(60), "the test never released the plan"
        return real(*args, **kwargs)

    monkeypatch.setattr(fleet, "evaluate", held)

    def status_fleet() -> dict:
        return ((emulator.get(emulator.CR, NS, NAME) or {}).get("status") or {}).get("fleet") or {}

    hpa_path = emulator.CHILDREN["HorizontalPodAutoscaler"]
    with KopfRunner(["run", "--standalone", "--all-namespaces", "-m", "kvserve.operator.handlers"], timeout=60) as r:
        emulator.call("POST", emulator.path(emulator.CR, NS), copy.deepcopy(BODY))
        pending = emulator.wait_for(lambda: status_fleet().get("planning") and status_fleet(), what="planning")
        assert not release.is_set()  # the reconcile finished while the plan was still held
        assert pending["feasible"] is False and "planning" in pending["reason"]
        hpa = emulator.wait_for(lambda: emulator.get(hpa_path, NS, NAME), what="the HPA")["spec"]
        assert (hpa["minReplicas"], hpa["maxReplicas"]) == (1, 4)  # spec.autoscaling's defaults meanwhile
        release.set()
        done = emulator.wait_for(lambda: status_fleet().get("feasible") and status_fleet(), what="the plan")
        assert "planning" not in done
        emulator.wait_for(
            lambda: emulator.get(hpa_path, NS, NAME)["spec"]["maxReplicas"] == done["maxReplicas"],
            what="the planned HPA bounds",
        )
    assert r.exit_code == 0 and r.exception is None and "Traceback" not in r.output, r.output[-3000:]
    fleet.plan_in_background(False)
    planned = spec_mod.resolve(BODY["spec"]).fleet  # the same plan, from the cache, for the CLI's path
    assert planned.hpa is not None and planned.hpa.max_replicas == done["maxReplicas"]

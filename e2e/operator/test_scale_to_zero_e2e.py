"""Scale from zero and spec.gateway end to end: kopf + the handlers against kmock create a KEDA ScaledObject
(and no HPA) and a GIE InferencePool; minReplicas back to 1 swaps the ScaledObject for the operator's HPA;
minReplicas 0 without the router is refused with a condition and nothing is created."""

from __future__ import annotations

import copy
import pathlib

import pytest
import yaml
from kopf.testing import KopfRunner

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "llama3-8b-scale-to-zero.yaml").read_text())
NS, NAME = EXAMPLE["metadata"]["namespace"], EXAMPLE["metadata"]["name"]
pytestmark = pytest.mark.timeout(90)


def _operator() -> KopfRunner:
    return KopfRunner(["run", "--standalone", "--all-namespaces", "-m", "kvserve.operator.handlers"], timeout=30)


def _condition(emulator, name: str, ctype: str) -> dict:
    status = (emulator.get(emulator.CR, NS, name) or {}).get("status") or {}
    return next((c for c in status.get("conditions") or [] if c["type"] == ctype), {})


def test_scaled_object_instead_of_hpa_then_back(emulator):
    obj = copy.deepcopy(EXAMPLE)
    obj["metadata"].update(uid="uid-burst", generation=1, resourceVersion="1")
    scaled, pool = emulator.SCALING_CHILDREN["ScaledObject"], emulator.SCALING_CHILDREN["InferencePool"]
    hpa = emulator.CHILDREN["HorizontalPodAutoscaler"]
    with _operator() as runner:
        emulator.call("POST", emulator.path(emulator.CR, NS), obj)
        so = emulator.wait_for(lambda: emulator.get(scaled, NS, NAME), what="the ScaledObject")
        assert so["spec"]["minReplicaCount"] == 0
        (ref,) = so["metadata"]["ownerReferences"]
        assert ref["uid"] == "uid-burst" and ref["controller"] is True
        ip = emulator.wait_for(lambda: emulator.get(pool, NS, NAME), what="the InferencePool")
        assert ip["spec"]["targetPorts"] == [{"number": 8000}]
        emulator.wait_for(lambda: emulator.get(emulator.CHILDREN["Deployment"], NS, NAME + "-router"), what="router")
        assert emulator.get(hpa, NS, NAME) is None  # KEDA owns the HPA
        emulator.call(
            "PATCH",
            emulator.path(emulator.CR, NS, NAME),
            {"metadata": {"generation": 2}, "spec": {"autoscaling": {"minReplicas": 1}, "gateway": None}},
            content_type="application/merge-patch+json",
        )
        emulator.wait_for(lambda: emulator.get(hpa, NS, NAME), what="the operator's HPA")
        emulator.wait_for(lambda: emulator.get(scaled, NS, NAME) is None, what="ScaledObject pruned")
        emulator.wait_for(lambda: emulator.get(pool, NS, NAME) is None, what="InferencePool pruned")
    assert runner.exit_code == 0 and runner.exception is None
    assert "Traceback" not in runner.output, runner.output[-3000:]


def test_scale_to_zero_without_router_is_refused_with_a_condition(emulator):
    obj = copy.deepcopy(EXAMPLE)
    obj["metadata"].update(name="norouter", uid="uid-norouter", generation=1, resourceVersion="1")
    obj["spec"]["router"] = {"enabled": False}
    with _operator() as runner:
        emulator.call("POST", emulator.path(emulator.CR, NS), obj)
        cond = emulator.wait_for(
            lambda: (
                _condition(emulator, "norouter", "CapacityPlanned").get("reason") == "ScaleToZeroNeedsRouter"
                and _condition(emulator, "norouter", "CapacityPlanned")
            ),
            what="the ScaleToZeroNeedsRouter condition",
        )
        assert cond["status"] == "False" and "spec.router.enabled" in cond["message"]
        assert _condition(emulator, "norouter", "Ready")["status"] == "False"
        assert emulator.get(emulator.CHILDREN["Deployment"], NS, "norouter") is None
        assert emulator.get(emulator.SCALING_CHILDREN["ScaledObject"], NS, "norouter") is None
    assert runner.exit_code == 0 and runner.exception is None

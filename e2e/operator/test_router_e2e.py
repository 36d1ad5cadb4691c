"""spec.router end to end: kopf + the handlers against kmock create the router's objects next to the engine's,
point status.url at the router, and prune them when the router is switched off."""

from __future__ import annotations

import pathlib

import pytest
import yaml
from kopf.testing import KopfRunner

ROOT = pathlib.Path(__file__).resolve().parents[2]
NS, NAME, ROUTER = "default", "llama70b", "llama70b-router"
pytestmark = pytest.mark.timeout(90)
ROUTER_OBJECTS = {
    "Deployment": "apps/v1/deployments",
    "Service": "v1/services",
    "PodDisruptionBudget": "policy/v1/poddisruptionbudgets",
    "ServiceAccount": "v1/serviceaccounts",
    "Role": "rbac.authorization.k8s.io/v1/roles",
    "RoleBinding": "rbac.authorization.k8s.io/v1/rolebindings",
}


def test_router_children_status_url_and_pruning(emulator):
    obj = yaml.safe_load((ROOT / "examples" / "llama70b.yaml").read_text())
    obj["metadata"].update(uid="uid-llama70b", generation=1, resourceVersion="1")
    obj["spec"]["router"] = {"enabled": True}

    def router_objects():
        return {kind: emulator.get(res, NS, ROUTER) for kind, res in ROUTER_OBJECTS.items()}

    def url():
        return ((emulator.get(emulator.CR, NS, NAME) or {}).get("status") or {}).get("url")

    with KopfRunner(
        ["run", "--standalone", "--all-namespaces", "-m", "kvserve.operator.handlers"], timeout=30
    ) as runner:
        emulator.call("POST", emulator.path(emulator.CR, NS), obj)
        emulator.wait_for(lambda: all(router_objects().values()), what="the router's six objects")
        assert emulator.get(emulator.CHILDREN["Deployment"], NS, NAME) is not None  # the engine's too
        for child in router_objects().values():
            (ref,) = child["metadata"]["ownerReferences"]
            assert ref["uid"] == "uid-llama70b" and ref["controller"] is True
        emulator.wait_for(lambda: url() == f"http://{ROUTER}.{NS}.svc.cluster.local:8000", what="router URL")
        emulator.call(
            "PATCH",
            emulator.path(emulator.CR, NS, NAME),
            {"metadata": {"generation": 2}, "spec": {"router": {"enabled": False}}},
            content_type="application/merge-patch+json",
        )
        emulator.wait_for(lambda: not any(router_objects().values()), what="router objects pruned")
        emulator.wait_for(lambda: url() == f"http://{NAME}.{NS}.svc.cluster.local:8000", what="engine URL")
        assert emulator.get(emulator.CHILDREN["Deployment"], NS, NAME) is not None
    assert runner.exit_code == 0 and runner.exception is None
    assert "Traceback" not in runner.output, runner.output[-3000:]

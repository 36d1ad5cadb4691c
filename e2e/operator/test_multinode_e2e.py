"""Replicas larger than one node end to end (issue 28): kopf + the handlers against kmock reconcile
examples/llama405b-multinode.yaml into a LeaderWorkerSet group (leader + headless worker, TP 8 x PP 2), the
group's authkey Secret, a Service on the leaders and an HPA on the LeaderWorkerSet's /scale, with
status.parallelism and readiness read from the LeaderWorkerSet; a cluster without the LeaderWorkerSet CRD gets a
condition and one Event instead of a crash. The emulator stands in for the LWS controller's status writes."""

from __future__ import annotations

import copy
import pathlib
import time

import pytest
import yaml
from kopf.testing import KopfRunner

from kvserve.operator import spec as spec_mod
from kvserve.operator.render import multinode as render_multinode

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "llama405b-multinode.yaml").read_text())
NS, NAME = EXAMPLE["metadata"]["namespace"], EXAMPLE["metadata"]["name"]
LWS_NAME = render_multinode.lws_name(NAME)
SECRET_NAME = render_multinode.authkey_secret_name(NAME)
pytestmark = pytest.mark.timeout(90)


def _operator() -> KopfRunner:
    return KopfRunner(["run", "--standalone", "--all-namespaces", "-m", "kvserve.operator.handlers"], timeout=30)


def _create(emulator) -> None:
    obj = copy.deepcopy(EXAMPLE)
    # What the API server would add on create; the emulator does not.
    obj["metadata"].update(uid="uid-405b", generation=1, resourceVersion="1")
    emulator.call("POST", emulator.path(emulator.CR, NS), obj)


def _cr(emulator) -> dict:
    return emulator.get(emulator.CR, NS, NAME) or {}


def _condition(emulator, ctype: str) -> dict:
    return next((c for c in (_cr(emulator).get("status") or {}).get("conditions", []) if c["type"] == ctype), {})


def _lws(emulator) -> dict | None:
    return emulator.get(emulator.MULTINODE_CHILDREN["LeaderWorkerSet"], NS, LWS_NAME)


def _secret(emulator) -> dict | None:
    return emulator.get(emulator.OTHERS["Secret"], NS, SECRET_NAME)


def _container(template: dict) -> dict:
    (container,) = template["spec"]["containers"]
    return container


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def _warnings(emulator, reason: str) -> list[dict]:
    return [
        r.data
        for r in emulator.requests()
        if r.method == "POST"
        and r.resource is not None
        and r.resource.plural == "events"
        and (r.data or {}).get("type") == "Warning"
        and r.data.get("reason") == reason
    ]


def _owned_by_the_cr(obj: dict) -> bool:
    return [(r["kind"], r["uid"], r.get("controller")) for r in obj["metadata"].get("ownerReferences") or []] == [
        ("InferenceService", "uid-405b", True)
    ]


def _assert_clean_run(runner: KopfRunner) -> None:
    assert runner.exit_code == 0 and runner.exception is None
    assert "Traceback" not in runner.output, runner.output[-3000:]


def test_405b_spec_becomes_a_leader_worker_set_group(emulator):
    resolved = spec_mod.resolve(EXAMPLE["spec"])
    layout = resolved.layout
    assert layout is not None and layout.nodes == 2  # the example needs two 8-GPU nodes (the test's premise)
    with _operator() as runner:
        _create(emulator)
        lws = emulator.wait_for(lambda: _lws(emulator), what="the LeaderWorkerSet")
        assert _owned_by_the_cr(lws)
        group = lws["spec"]["leaderWorkerTemplate"]
        assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
        assert "replicas" not in lws["spec"]  # autoscaling on: the HPA owns it through the LWS's /scale
        leader, worker = _container(group["leaderTemplate"]), _container(group["workerTemplate"])
        for container, rank in ((leader, "0"), (worker, "$(LWS_WORKER_INDEX)")):
            cmd = container["command"]
            assert _flag(cmd, "--tensor-parallel-size") == "8" and _flag(cmd, "--pipeline-parallel-size") == "2"
            assert _flag(cmd, "--nnodes") == "2" and _flag(cmd, "--node-rank") == rank
            assert _flag(cmd, "--master-addr") == "$(LWS_LEADER_ADDRESS)"
            assert int(_flag(cmd, "--kv-cache-bytes")) == resolved.plan.kv_cache_bytes_per_gpu
            assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
            (authkey,) = [e for e in container["env"] if e["name"] == render_multinode.AUTHKEY_ENV]
            assert authkey["valueFrom"]["secretKeyRef"] == {"name": SECRET_NAME, "key": render_multinode.AUTHKEY_KEY}
        assert "--headless" in worker["command"] and "--headless" not in leader["command"]
        assert "readinessProbe" in leader and "readinessProbe" not in worker  # the worker serves no HTTP

        # The group's shared key: created once by the operator, with a random value, owned by the CR.
        secret = emulator.wait_for(lambda: _secret(emulator), what="the authkey Secret")
        assert _owned_by_the_cr(secret)
        key = secret["stringData"][render_multinode.AUTHKEY_KEY]
        assert len(key) >= 32
        # The API Service selects the leaders only; the HPA scales the LWS (groups), not the CR or a Deployment.
        svc = emulator.wait_for(lambda: emulator.get(emulator.CHILDREN["Service"], NS, NAME), what="the Service")
        assert svc["spec"]["selector"][render_multinode.ROLE_LABEL] == "leader"
        hpa = emulator.wait_for(
            lambda: emulator.get(emulator.CHILDREN["HorizontalPodAutoscaler"], NS, NAME), what="the HPA"
        )
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "leaderworkerset.x-k8s.io/v1",
            "kind": "LeaderWorkerSet",
            "name": LWS_NAME,
        }
        assert emulator.get(emulator.CHILDREN["Deployment"], NS, NAME) is None

        status = emulator.wait_for(
            lambda: _cr(emulator).get("status", {}).get("parallelism") and _cr(emulator)["status"]
        )
        assert status["parallelism"] == layout.to_status()
        assert status["parallelism"]["gpusPerReplica"] == 16 and sum(status["parallelism"]["stageLayers"]) == 126
        assert status["plan"]["kvCacheBytesPerGpu"] == resolved.plan.kv_cache_bytes_per_gpu
        assert _condition(emulator, "Ready")["reason"] == "ReplicasNotReady"

        # The HPA writes the LWS's /scale; the LWS controller reports the groups it runs. The operator must
        # neither undo the HPA's count nor regenerate the key on its resyncs (0.5 s here).
        lws_resource = emulator.MULTINODE_CHILDREN["LeaderWorkerSet"]
        emulator.call(
            "PATCH",
            emulator.path(lws_resource, NS, LWS_NAME) + "/scale",
            {"spec": {"replicas": 2}},
            content_type="application/merge-patch+json",
        )
        emulator.call(
            "PATCH",
            emulator.path(lws_resource, NS, LWS_NAME) + "/status",
            {"status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}},
            content_type="application/merge-patch+json",
        )
        emulator.wait_for(lambda: _condition(emulator, "Ready").get("status") == "True", what="Ready from the LWS")
        assert _cr(emulator)["status"]["readyReplicas"] == 2
        time.sleep(2)  # several resyncs
        assert _lws(emulator)["spec"]["replicas"] == 2
        assert _secret(emulator)["stringData"][render_multinode.AUTHKEY_KEY] == key
        assert _condition(emulator, "Degraded")["status"] == "False"
    _assert_clean_run(runner)


@pytest.mark.parametrize("emulator", [{"unserved": ["LeaderWorkerSet"]}], indirect=True)
def test_without_the_leader_worker_set_crd_the_status_says_install_it(emulator):
    with _operator() as runner:
        _create(emulator)
        ready = emulator.wait_for(
            lambda: (
                _condition(emulator, "Ready").get("reason") == "LeaderWorkerSetMissing"
                and _condition(emulator, "Ready")
            ),
            what="Ready=False LeaderWorkerSetMissing",
        )
        assert ready["status"] == "False"
        assert "leaderworkerset.x-k8s.io/v1 is not served" in ready["message"]
        assert "install LeaderWorkerSet" in ready["message"] and "lws/releases" in ready["message"]
        degraded = _condition(emulator, "Degraded")
        assert degraded["status"] == "True" and degraded["reason"] == "CRDNotInstalled"
        assert _condition(emulator, "CapacityPlanned")["status"] == "True"  # the plan is fine; the cluster lacks LWS
        assert _cr(emulator)["status"]["parallelism"]["nodes"] == 2
        # The children from built-in kinds are applied before the optional kind, so they exist already.
        assert emulator.get(emulator.CHILDREN["Service"], NS, NAME) is not None
        assert _secret(emulator) is not None
        assert emulator.get(emulator.CHILDREN["Deployment"], NS, NAME) is None  # no one-pod fallback
        time.sleep(2)  # several resyncs: the condition stays, the Event is not repeated
        events = [e for e in _warnings(emulator, "CRDNotInstalled") if e["involvedObject"]["name"] == NAME]
        assert len(events) == 1 and "install LeaderWorkerSet" in events[0]["message"]
        assert _condition(emulator, "Ready")["reason"] == "LeaderWorkerSetMissing"
    _assert_clean_run(runner)

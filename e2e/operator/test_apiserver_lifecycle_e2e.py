"""The InferenceService's own life on a real API server: kopf + kvserve's handlers (kopf.testing.KopfRunner)
against the real apiextensions-apiserver for the InferenceService (and the upstream kinds), with the children
the real server cannot hold (Deployments, Services, HPAs, PDBs, NetworkPolicies, Secrets, Events) on the
emulator, both behind one router (e2e/operator/hybrid.py; fixture `hybrid` in conftest.py).

The real server brings what the emulator does not: uid, generation and resourceVersion bookkeeping, structural
defaulting and validation on create, the /status and /scale subresources (a status write cannot touch the spec,
a scale write bumps the generation), deletion semantics, and watches that expire with 410 Gone.
"""

from __future__ import annotations

import pathlib
import re
import time

import pytest
import yaml
from kopf.testing import KopfRunner

ROOT = pathlib.Path(__file__).resolve().parents[2]
NS = "kvs-life"
pytestmark = pytest.mark.timeout(180)
MERGE = "application/merge-patch+json"


def _runner() -> KopfRunner:
    return KopfRunner(["run", "--standalone", "--all-namespaces", "-m", "kvserve.operator.handlers"], timeout=60)


def _example(name: str) -> dict:
    obj = yaml.safe_load((ROOT / "examples" / name).read_text())
    obj["metadata"]["namespace"] = NS
    return obj


def _condition(cr: dict, ctype: str) -> dict:
    return next((c for c in (cr.get("status") or {}).get("conditions") or [] if c["type"] == ctype), {})


def _settled(hybrid, name: str, generation: int) -> dict | None:
    cr = hybrid.server.request("GET", hybrid.cr_path(NS, name))
    status = cr.get("status") or {}
    if status.get("observedGeneration") == generation and _condition(cr, "CapacityPlanned").get("status") == "True":
        return cr
    return None


def _deployment_replicas(hybrid, name: str) -> int | None:
    dep = hybrid.emulator.get(hybrid.emulator.CHILDREN["Deployment"], NS, name)
    return (dep or {}).get("spec", {}).get("replicas")


def _create(hybrid, obj: dict) -> dict:
    return hybrid.server.request("POST", hybrid.cr_path(NS), obj, query={"fieldValidation": "Strict"})


def _delete(hybrid, name: str) -> None:
    hybrid.server.request("DELETE", hybrid.cr_path(NS, name))
    hybrid.emulator.wait_for(
        lambda: (
            not hybrid.server.request("GET", hybrid.cr_path(NS), query={"fieldSelector": f"metadata.name={name}"})[
                "items"
            ]
        ),
        what=f"{name} deleted on the real server",
    )


_OUTAGE_CONNECTION_ERRORS = tuple(
    f"aiohttp.client_exceptions.{name}"
    for name in ("ClientConnectionResetError", "ClientConnectorError", "ServerDisconnectedError", "ClientOSError")
)


def _clean_exit(runner: KopfRunner, outage: bool = False) -> None:
    """kopf ended cleanly; no traceback, except (`outage`) those of the API calls made while the server was down:
    answered 503 (the resync logs them; kubernetes' ApiException is the cause a KubeError chains), or cut at the
    connection by the restart (aiohttp's connection errors: which of them a run sees depends on timing)."""
    assert runner.exit_code == 0 and runner.exception is None, runner.output[-3000:]
    if not outage:
        assert "Traceback" not in runner.output, runner.output[-3000:]
        return
    raised = re.findall(r"^([\w.]+(?:Error|Exception)(?:\([^)]*\))?:? .*)$", runner.output, flags=re.M)
    assert runner.output.count("Traceback") <= len(raised)
    unexpected = [
        line
        for line in raised
        if "503" not in line and "Service Unavailable" not in line and not line.startswith(_OUTAGE_CONNECTION_ERRORS)
    ]
    assert not unexpected, unexpected[:5]


def test_create_status_scale_and_delete_on_the_real_server(hybrid):
    obj = _example("llama3-8b-l4.yaml")
    name = obj["metadata"]["name"]
    with _runner() as runner:
        created = _create(hybrid, obj)
        uid, generation = created["metadata"]["uid"], created["metadata"]["generation"]
        assert created["spec"]["engine"]["maxModelLen"] == obj["spec"]["engine"].get("maxModelLen", 8192)  # defaulted
        cr = hybrid.emulator.wait_for(lambda: _settled(hybrid, name, generation), what="status of generation 1")
        # Children on the emulator, owned by the uid the real server gave.
        dep = hybrid.emulator.wait_for(
            lambda: hybrid.emulator.get(hybrid.emulator.CHILDREN["Deployment"], NS, name), what="the Deployment"
        )
        assert [r["uid"] for r in dep["metadata"]["ownerReferences"]] == [uid]
        status = cr["status"]
        assert status["plan"]["kvTokens"] > 0 and status["selector"] and "parallelism" not in status
        # Written through /status (the real server ignores status in a write to the main resource).
        writes = [(m, p) for m, p, code in hybrid.router.requests if m in ("PATCH", "PUT") and code < 300]
        assert ("PATCH", hybrid.cr_path(NS, name, "status")) in writes
        # No finalizer: by design (operator/handlers.py), so `kubectl delete` never waits for the operator.
        assert not cr["metadata"].get("finalizers")

        # /scale: the server maps it onto spec.replicas (a new generation); the operator follows.
        scale = hybrid.server.request(
            "PATCH", hybrid.cr_path(NS, name, "scale"), {"spec": {"replicas": 3}}, content_type=MERGE
        )
        assert scale["spec"]["replicas"] == 3 and scale["status"]["selector"] == status["selector"]
        hybrid.emulator.wait_for(lambda: _deployment_replicas(hybrid, name) == 3, what="Deployment replicas 3")
        hybrid.emulator.wait_for(lambda: _settled(hybrid, name, generation + 1), what="status of generation 2")

        _delete(hybrid, name)
    _clean_exit(runner)


def test_a_multinode_replica_writes_its_parallelism_and_a_real_leaderworkerset(hybrid):
    obj = _example("llama405b-multinode.yaml")
    name = obj["metadata"]["name"]
    with _runner() as runner:
        created = _create(hybrid, obj)
        cr = hybrid.emulator.wait_for(
            lambda: _settled(hybrid, name, created["metadata"]["generation"]), timeout=60, what="status"
        )
        parallelism = cr["status"]["parallelism"]
        assert parallelism["nodes"] > 1 and parallelism["pipelineParallelSize"] == parallelism["nodes"]
        assert parallelism["tensorParallelSize"] * parallelism["nodes"] == parallelism["gpusPerReplica"]
        lws_path = f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NS}/leaderworkersets/{name}-lws"
        lws = hybrid.emulator.wait_for(lambda: _get_or_none(hybrid.server, lws_path), what="the LeaderWorkerSet")
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == parallelism["nodes"]
        assert lws["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
        _delete(hybrid, name)
        hybrid.server.request("DELETE", lws_path)  # no garbage collector on this server
    _clean_exit(runner)


def _get_or_none(server, path: str) -> dict | None:
    from tests.operator.apiserver import ApiError

    try:
        return server.request("GET", path)
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


def test_the_operator_survives_a_410_and_a_server_restart(hybrid):
    obj = _example("llama3-8b-l4.yaml")
    name = obj["metadata"]["name"]
    cr_watch = hybrid.cr_path(NS).replace(f"/namespaces/{NS}", "")  # kopf watches all namespaces
    with _runner() as runner:
        generation = _create(hybrid, obj)["metadata"]["generation"]
        hybrid.emulator.wait_for(lambda: _settled(hybrid, name, generation), what="status")
        hybrid.emulator.wait_for(lambda: _deployment_replicas(hybrid, name) == 2, what="the example's 2 replicas")
        hybrid.emulator.wait_for(
            lambda: any(w.path == cr_watch for w in hybrid.router.watches), what="kopf's watch of InferenceServices"
        )

        # 410: writes elsewhere move etcd on, a compaction drops the history, the stream is cut; kopf's next
        # watch starts from its last resourceVersion, which etcd no longer has.
        bump = {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": "bumps.e2e.kvserve.dev"},
            "spec": {
                "group": "e2e.kvserve.dev",
                "scope": "Namespaced",
                "names": {"plural": "bumps", "singular": "bump", "kind": "Bump"},
                "versions": [
                    {
                        "name": "v1",
                        "served": True,
                        "storage": True,
                        "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                    }
                ],
            },
        }
        hybrid.server.apply_crd(bump)
        for i in range(3):
            hybrid.server.request(
                "POST",
                f"/apis/e2e.kvserve.dev/v1/namespaces/{NS}/bumps",
                {"apiVersion": "e2e.kvserve.dev/v1", "kind": "Bump", "metadata": {"name": f"b{time.time_ns()}{i}"}},
            )
        hybrid.server.etcd_compact()
        assert hybrid.router.cut_watches() >= 1
        hybrid.emulator.wait_for(
            lambda: any(w.gone and w.path == cr_watch for w in hybrid.router.watches), what="a watch answered 410 Gone"
        )
        hybrid.server.request("PATCH", hybrid.cr_path(NS, name, "scale"), {"spec": {"replicas": 3}}, content_type=MERGE)
        hybrid.emulator.wait_for(lambda: _deployment_replicas(hybrid, name) == 3, what="replicas 3 after the 410")

        # A server restart (etcd keeps the data): the watch breaks, kopf reconnects when it is back.
        hybrid.server.stop_server()
        time.sleep(1.0)
        hybrid.server.start_server()
        hybrid.server.request("PATCH", hybrid.cr_path(NS, name, "scale"), {"spec": {"replicas": 4}}, content_type=MERGE)
        hybrid.emulator.wait_for(
            lambda: _deployment_replicas(hybrid, name) == 4, timeout=60, what="replicas 4 after the restart"
        )
        live = hybrid.server.request("GET", hybrid.cr_path(NS, name))
        assert live["metadata"]["generation"] == generation + 2, live["metadata"]
        hybrid.emulator.wait_for(
            lambda: _settled(hybrid, name, generation + 2),
            what=f"status after the restart: {hybrid.server.request('GET', hybrid.cr_path(NS, name)).get('status')}",
        )
        _delete(hybrid, name)
    _clean_exit(runner, outage=True)

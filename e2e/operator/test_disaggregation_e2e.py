"""Disaggregated prefill/decode end to end (issue 42 scope 4): kopf + the handlers against kmock reconcile
examples/llama70b-disaggregated.yaml into a prefill and a decode Deployment, an HPA per pool and the router in
P/D mode; the status shows both pools and is Ready only once both are; /scale scales the decode pool while the
prefill HPA's count is left alone; switching disaggregation off prunes the pools. The emulator stands in for the
Deployment controller's and the HPA's writes."""

from __future__ import annotations

import copy
import json
import pathlib
import time

import pytest
import yaml
from kopf.testing import KopfRunner

from kvserve.operator import spec as spec_mod
from kvserve.operator.render import disaggregation as render_pd

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "llama70b-disaggregated.yaml").read_text())
NS, NAME = EXAMPLE["metadata"]["namespace"], EXAMPLE["metadata"]["name"]
PREFILL, DECODE = f"{NAME}-prefill", f"{NAME}-decode"
pytestmark = pytest.mark.timeout(90)


def _operator() -> KopfRunner:
    # 60 s to stop: on the shared 2-core machine the reconciles that the pools' pruning triggers (one per child
    # event, each reading some twenty children) may still be draining when the test ends.
    return KopfRunner(["run", "--standalone", "--all-namespaces", "-m", "kvserve.operator.handlers"], timeout=60)


def _cr(emulator) -> dict:
    return emulator.get(emulator.CR, NS, NAME) or {}


def _condition(emulator, ctype: str) -> dict:
    return next((c for c in (_cr(emulator).get("status") or {}).get("conditions", []) if c["type"] == ctype), {})


def _get(emulator, kind: str, name: str) -> dict | None:
    return emulator.get(emulator.CHILDREN[kind], NS, name)


def _patch(emulator, kind: str, name: str, body: dict, subresource: str = "") -> None:
    emulator.call(
        "PATCH",
        emulator.path(emulator.CHILDREN[kind], NS, name) + subresource,
        body,
        content_type="application/merge-patch+json",
    )


def _command(dep: dict) -> list[str]:
    return dep["spec"]["template"]["spec"]["containers"][0]["command"]


def test_the_two_pool_service_is_reconciled_with_both_pools_in_the_status(emulator):
    resolved = spec_mod.resolve(copy.deepcopy(EXAMPLE["spec"]))
    with _operator() as runner:
        obj = copy.deepcopy(EXAMPLE)
        obj["metadata"].update(uid="uid-pd", generation=1, resourceVersion="1")
        emulator.call("POST", emulator.path(emulator.CR, NS), obj)

        prefill = emulator.wait_for(lambda: _get(emulator, "Deployment", PREFILL), what="the prefill Deployment")
        decode = emulator.wait_for(lambda: _get(emulator, "Deployment", DECODE), what="the decode Deployment")
        for dep, pool in ((prefill, resolved.pools.prefill), (decode, resolved.pools.decode)):
            cmd = _command(dep)
            config = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
            assert config == {"kv_connector": "NixlConnector", "kv_role": pool.kv_role}
            assert dep["spec"]["template"]["metadata"]["labels"][render_pd.ROLE_LABEL] == pool.role
            assert [r["uid"] for r in dep["metadata"]["ownerReferences"]] == ["uid-pd"]
        assert "replicas" not in prefill["spec"] and decode["spec"]["replicas"] == 2
        assert _get(emulator, "Deployment", NAME) is None  # no aggregated pool
        router = emulator.wait_for(lambda: _get(emulator, "Deployment", f"{NAME}-router"), what="the router")
        pd_args = render_pd.router_pd_args(resolved.pools)
        assert _command(router)[-len(pd_args) :] == pd_args
        for pool in (PREFILL, DECODE):
            emulator.wait_for(lambda p=pool: _get(emulator, "HorizontalPodAutoscaler", p), what=f"HPA {pool}")
            emulator.wait_for(lambda p=pool: _get(emulator, "PodDisruptionBudget", p), what=f"PDB {pool}")

        status = emulator.wait_for(
            lambda: _cr(emulator).get("status", {}).get("disaggregation") and _cr(emulator)["status"]
        )
        assert status["selector"] == render_pd.scale_selector(NAME)
        assert status["plan"]["kvTokens"] == resolved.pools.decode.plan.kv_tokens
        assert status["disaggregation"]["prefill"]["tensorParallelSize"] == 4
        assert status["disaggregation"]["decode"]["kvTokens"] == resolved.pools.decode.plan.kv_tokens
        assert _condition(emulator, "Ready")["status"] == "False"

        # The prefill HPA sets its Deployment's replicas; the Deployment controller reports ready pods.
        _patch(emulator, "Deployment", PREFILL, {"spec": {"replicas": 2}})
        _patch(
            emulator,
            "Deployment",
            DECODE,
            {"status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}},
            "/status",
        )
        emulator.wait_for(
            lambda: _condition(emulator, "Ready").get("reason") == "PrefillNotReady", what="PrefillNotReady"
        )
        _patch(
            emulator,
            "Deployment",
            PREFILL,
            {"status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}},
            "/status",
        )
        emulator.wait_for(lambda: _condition(emulator, "Ready").get("status") == "True", what="Ready from both pools")
        status = _cr(emulator)["status"]
        assert status["disaggregation"]["prefill"]["readyReplicas"] == 2
        assert status["readyReplicas"] == 2 and status["url"].startswith(f"http://{NAME}-router.")

        # /scale (kubectl scale, the decode HPA) scales the decode pool; the prefill HPA's count stays.
        emulator.call(
            "PATCH",
            emulator.path(emulator.CR, NS, NAME) + "/scale",
            {"spec": {"replicas": 3}},
            content_type="application/merge-patch+json",
        )
        emulator.wait_for(lambda: _get(emulator, "Deployment", DECODE)["spec"]["replicas"] == 3, what="decode 3")
        time.sleep(2)  # several resyncs (0.5 s)
        assert _get(emulator, "Deployment", PREFILL)["spec"]["replicas"] == 2

        # Disaggregation off: the pools are pruned and one aggregated Deployment serves.
        emulator.call(
            "PATCH",
            emulator.path(emulator.CR, NS, NAME),
            {"metadata": {"generation": 2}, "spec": {"disaggregation": None, "gpu": {"tensorParallelSize": 8}}},
            content_type="application/merge-patch+json",
        )
        emulator.wait_for(lambda: _get(emulator, "Deployment", NAME), what="the aggregated Deployment")
        emulator.wait_for(
            lambda: all(
                _get(emulator, k, p) is None
                for k in ("Deployment", "HorizontalPodAutoscaler")
                for p in (PREFILL, DECODE)
            ),
            what="the pools pruned",
        )
        emulator.wait_for(lambda: "disaggregation" not in _cr(emulator).get("status", {}), what="status without pools")
        emulator.wait_for(lambda: _cr(emulator)["status"].get("observedGeneration") == 2, what="generation 2")
        time.sleep(1)  # let the child events of the pruning drain before the operator is stopped
    assert runner.exit_code == 0 and runner.exception is None
    assert "Traceback" not in runner.output, runner.output[-3000:]


def _get_or_none(server, path: str) -> dict | None:
    from tests.operator.apiserver import ApiError

    try:
        return server.request("GET", path)
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


def test_pools_spanning_nodes_on_the_real_api_server(hybrid):
    """The InferenceService and its LeaderWorkerSet pools on the real API server (the rest on the emulator): the
    CR is admitted under strict validation, the status with both pools passes the CRD's status schema, and each
    pool's LeaderWorkerSet is created against the upstream LWS CRD, owned by the CR."""
    from tests.operator.test_render_disagg import PD_405B

    ns, name = "kvs-pd", "pd405"
    obj = {
        "apiVersion": spec_mod.API_VERSION,
        "kind": spec_mod.KIND,
        "metadata": {"name": name, "namespace": ns},
        "spec": copy.deepcopy(PD_405B),
    }
    with _operator() as runner:
        created = hybrid.server.request("POST", hybrid.cr_path(ns), obj, query={"fieldValidation": "Strict"})

        def settled() -> dict | None:
            cr = hybrid.server.request("GET", hybrid.cr_path(ns, name))
            return cr if (cr.get("status") or {}).get("disaggregation") else None

        cr = hybrid.emulator.wait_for(settled, timeout=60, what="status with both pools")
        pools = cr["status"]["disaggregation"]
        assert pools["prefill"]["nodes"] == pools["decode"]["nodes"] == 2
        assert pools["prefill"]["tensorParallelSize"] == pools["decode"]["tensorParallelSize"] == 8
        paths = [
            f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{ns}/leaderworkersets/{name}-{r}-lws"
            for r in ("prefill", "decode")
        ]
        for path, role in zip(paths, ("prefill", "decode")):
            lws = hybrid.emulator.wait_for(lambda p=path: _get_or_none(hybrid.server, p), what=f"the {role} LWS")
            assert lws["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
            assert lws["metadata"]["labels"][render_pd.ROLE_LABEL] == role
            assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
        hybrid.server.request("DELETE", hybrid.cr_path(ns, name))
        for path in paths:  # no garbage collector on this server
            hybrid.server.request("DELETE", path)
    assert runner.exit_code == 0 and runner.exception is None
    assert "Traceback" not in runner.output, runner.output[-3000:]

"""kopf + kvserve's handlers against kmock's in-memory Kubernetes API (KubernetesEmulator) on 127.0.0.1.

The emulator runs on its own event loop in a background thread, so tests stay synchronous and the operator
(kopf.testing.KopfRunner, another thread) and the test both talk to it over HTTP like real clients.
The emulator stores objects as they are sent: no defaulting, no schema validation, no uid/generation
bookkeeping and no garbage collection; tests set uid/generation themselves and check ownerReferences.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("KVSERVE_RESYNC_SECONDS", "0.5")  # read when the handlers module is imported

import kmock  # noqa: E402
import kopf  # noqa: E402
import pytest  # noqa: E402

CR = "serving.kvserve.dev/v1alpha1/inferenceservices"
CHILDREN = {
    "Deployment": "apps/v1/deployments",
    "Service": "v1/services",
    "HorizontalPodAutoscaler": "autoscaling/v2/horizontalpodautoscalers",
    "PodDisruptionBudget": "policy/v1/poddisruptionbudgets",
    "NetworkPolicy": "networking.k8s.io/v1/networkpolicies",
}
# spec.router's extra kinds (its Deployment, Service and PDB are named <name>-router).
ROUTER_CHILDREN = {
    "ServiceAccount": "v1/serviceaccounts",
    "Role": "rbac.authorization.k8s.io/v1/roles",
    "RoleBinding": "rbac.authorization.k8s.io/v1/rolebindings",
}
# Kinds from optional CRDs (KEDA, GIE) the operator renders for scale from zero and spec.gateway.
SCALING_CHILDREN = {
    "ScaledObject": "keda.sh/v1alpha1/scaledobjects",
    "InferencePool": "inference.networking.k8s.io/v1/inferencepools",
}
# A replica larger than one node (spec.parallelism, issue 28), from the optional LeaderWorkerSet CRD.
MULTINODE_CHILDREN = {"LeaderWorkerSet": "leaderworkerset.x-k8s.io/v1/leaderworkersets"}
# Read (pods, secrets) or used (leases) by the operator, written by the tests in the kubelet's/user's place.
OTHERS = {"Pod": "v1/pods", "Secret": "v1/secrets", "Lease": "coordination.k8s.io/v1/leases"}
_ALL_VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}
_server_url: str | None = None


def _wait_for_reconciles(timeout: float = 40.0) -> None:
    """Let reconciles still running finish against this test's server. KopfRunner closes its loop without waiting
    for the executor threads that run sync handlers and the resync, and the API client is a module global the next
    test's fixture re-points: a reconcile that read this test's InferenceService could otherwise write its children
    into the next test's server. Each reconcile holds its object's lock from start to end (operator/handlers.py)."""
    from kvserve.operator import handlers

    with handlers._locks_guard:
        locks = list(handlers._locks.values())
    for lock in locks:
        if lock.acquire(timeout=timeout):
            lock.release()


@kopf.on.login()
def _login_to_emulator(**_: Any) -> kopf.ConnectionInfo:
    assert _server_url, "the emulator fixture is not running"
    return kopf.ConnectionInfo(server=_server_url)


class _KubernetesEmulator(kmock.KubernetesEmulator):
    """Answers 404 for the resources in `unserved` (a cluster without that optional CRD) before the emulator
    stores anything: kmock itself accepts a create of any resource, declared or not."""

    unserved: frozenset[Any] = frozenset()

    async def _handle(self, request: Any) -> Any:
        if request.resource is not None and request.resource in self.unserved:
            raise kmock.KubernetesResourceNotFoundError()
        return await super()._handle(request)


class Emulator:
    """A running KubernetesEmulator plus a tiny synchronous JSON client for the test body."""

    CR = CR
    CHILDREN = CHILDREN
    SCALING_CHILDREN = SCALING_CHILDREN
    MULTINODE_CHILDREN = MULTINODE_CHILDREN
    OTHERS = OTHERS

    def __init__(self, handler: kmock.KubernetesEmulator, url: str, loop: asyncio.AbstractEventLoop):
        self.handler, self.url, self.loop = handler, url, loop

    def call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.url.rstrip("/") + path,
            data=data,
            method=method,
            headers={"Content-Type": content_type, "Accept": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    def get(self, resource: str, namespace: str, name: str) -> dict | None:
        prefix = "/api" if resource.startswith("v1/") else "/apis"
        version, plural = resource.rsplit("/", 1)
        return self.call("GET", f"{prefix}/{version}/namespaces/{namespace}/{plural}/{name}")

    def path(self, resource: str, namespace: str, name: str | None = None) -> str:
        prefix = "/api" if resource.startswith("v1/") else "/apis"
        version, plural = resource.rsplit("/", 1)
        return f"{prefix}/{version}/namespaces/{namespace}/{plural}" + (f"/{name}" if name else "")

    def requests(self) -> list[Any]:
        return list(self.handler)

    def wait_for(self, predicate: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture()
def emulator(request: pytest.FixtureRequest) -> Iterator[Emulator]:
    """`@pytest.mark.parametrize("emulator", [{"unserved": ["LeaderWorkerSet"]}], indirect=True)`: kinds of
    the optional CRDs this cluster does not serve (not in discovery, every request 404)."""
    global _server_url
    unserved = set((getattr(request, "param", None) or {}).get("unserved", ()))
    optional = {**SCALING_CHILDREN, **MULTINODE_CHILDREN}
    loop = asyncio.new_event_loop()
    started = threading.Event()
    stop: asyncio.Event | None = None
    box: dict[str, Any] = {}

    async def serve() -> None:
        nonlocal stop
        stop = asyncio.Event()
        async with _KubernetesEmulator() as handler, kmock.Server(handler) as server:
            handler.unserved = frozenset(kmock.resource(optional[kind]) for kind in unserved)
            info = kmock.ResourceInfo
            handler.resources["v1/namespaces"] = info(kind="Namespace", namespaced=False, verbs=_ALL_VERBS)
            handler.resources["v1/events"] = info(kind="Event", namespaced=True, verbs=_ALL_VERBS)
            handler.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = info(
                kind="CustomResourceDefinition", namespaced=False, verbs=_ALL_VERBS
            )
            handler.resources[CR] = info(
                kind="InferenceService",
                namespaced=True,
                verbs=_ALL_VERBS,
                subresources={"status", "scale"},
                shortnames={"kvs"},
            )
            for kind, resource in {**CHILDREN, **ROUTER_CHILDREN, **SCALING_CHILDREN, **OTHERS}.items():
                if kind not in unserved:
                    handler.resources[resource] = info(kind=kind, namespaced=True, verbs=_ALL_VERBS)
            for kind, resource in MULTINODE_CHILDREN.items():
                if kind not in unserved:  # the HPA scales the LWS through its /scale
                    handler.resources[resource] = info(
                        kind=kind, namespaced=True, verbs=_ALL_VERBS, subresources={"status", "scale"}
                    )
            box["handler"], box["url"] = handler, str(server.url)
            started.set()
            await stop.wait()

    thread = threading.Thread(target=lambda: loop.run_until_complete(serve()), daemon=True)
    thread.start()
    assert started.wait(10), "emulator did not start"
    _server_url = box["url"]
    from kvserve.operator import kube

    kube.configure(host=_server_url)
    try:
        yield Emulator(box["handler"], box["url"], loop)
    finally:
        _wait_for_reconciles()
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        _server_url = None
        kube._client = None


class Hybrid:
    """The real API server (custom resources) and the emulator (everything else) behind one router URL, which
    the operator under test talks to (e2e/operator/hybrid.py)."""

    def __init__(self, server: Any, router: Any, emulator: Emulator):
        self.server, self.router, self.emulator = server, router, emulator

    def cr_path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        out = f"/apis/serving.kvserve.dev/v1alpha1/namespaces/{namespace}/inferenceservices"
        return out + (f"/{name}" if name else "") + (f"/{subresource}" if subresource else "")


@pytest.fixture()
def hybrid(emulator: Emulator) -> Iterator[Hybrid]:
    """The operator's API endpoint made of the real API server (tests/operator/apiserver.py: the InferenceService
    and the upstream kinds, with their CRDs) and the emulator (Deployments, Services, HPAs, Events...). Skips
    (fails in CI) where the real server cannot be had."""
    global _server_url
    import pathlib

    import yaml

    from e2e.operator import hybrid as hybrid_mod
    from kvserve.operator import kube
    from tests.operator import apiserver as apiserver_mod
    from tests.operator import upstream_crds

    server = apiserver_mod.shared()
    root = pathlib.Path(__file__).resolve().parents[2]
    server.apply_crd(yaml.safe_load((root / "crds" / "inferenceservices.serving.kvserve.dev.yaml").read_text()))
    for crd in upstream_crds.crds():
        server.apply_crd(crd)
    router = hybrid_mod.Router(real_url=server.url, real_ssl=server.context, emulator_url=emulator.url)
    router.start()
    _server_url = router.url
    kube.configure(host=router.url)
    try:
        yield Hybrid(server, router, emulator)
    finally:
        _wait_for_reconciles()
        router.stop()

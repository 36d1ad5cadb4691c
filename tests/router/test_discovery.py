"""EndpointSlice discovery: the pure slice -> endpoints mapping, and the watcher against kmock's Kubernetes
emulator (list, then watch: a pod becoming ready, terminating, and its slice going away)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvserve.runtime.router.discovery import SERVICE_NAME_LABEL, EndpointSliceWatcher, endpoints_from_slices

pytestmark = pytest.mark.timeout(60)


def _slice(name: str, service: str, endpoints: list[tuple[str, dict]], port: int = 8000) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "addressType": "IPv4",
        "metadata": {"name": name, "namespace": "ns", "labels": {SERVICE_NAME_LABEL: service}},
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}, {"name": "metrics", "port": 9090}],
        "endpoints": [{"addresses": [ip], "conditions": cond} for ip, cond in endpoints],
    }


READY = {"ready": True, "serving": True, "terminating": False}
TERMINATING = {"ready": False, "serving": True, "terminating": True}
STARTING = {"ready": False, "serving": False, "terminating": False}


def test_endpoints_from_slices():
    slices = [
        _slice("s1", "svc", [("10.0.0.1", READY), ("10.0.0.2", TERMINATING), ("10.0.0.3", STARTING)]),
        _slice("s2", "svc", [("10.0.0.4", {}), ("", READY)]),  # nil conditions = ready; empty IP skipped
        {
            "metadata": {"name": "s3"},
            "ports": [{"name": "http", "port": 8000}],
            "endpoints": [{"addresses": ["fd00::5"], "conditions": READY}],
        },
    ]
    ready, draining = endpoints_from_slices(slices, "http")
    assert ready == {"http://10.0.0.1:8000", "http://10.0.0.4:8000", "http://[fd00::5]:8000"}
    assert draining == {"http://10.0.0.2:8000"}
    assert endpoints_from_slices(slices, "metrics")[0] == {"http://10.0.0.1:9090", "http://10.0.0.4:9090"}
    assert endpoints_from_slices(slices, "grpc") == (set(), set())


@pytest.fixture()
def emulator():
    import kmock
    import kubernetes

    loop = asyncio.new_event_loop()
    started, box = threading.Event(), {}

    async def serve() -> None:
        box["stop"] = asyncio.Event()
        async with kmock.KubernetesEmulator() as handler, kmock.Server(handler) as server:
            handler.resources["discovery.k8s.io/v1/endpointslices"] = kmock.ResourceInfo(
                kind="EndpointSlice", namespaced=True, verbs={"get", "list", "watch", "create", "patch", "delete"}
            )
            box["url"] = str(server.url)
            started.set()
            await box["stop"].wait()

    thread = threading.Thread(target=lambda: loop.run_until_complete(serve()), daemon=True)
    thread.start()
    assert started.wait(10)
    config = kubernetes.client.Configuration()
    config.host = box["url"].rstrip("/")
    api = kubernetes.client.ApiClient(config)
    yield api
    loop.call_soon_threadsafe(box["stop"].set)
    thread.join(10)


def test_watcher_follows_endpointslices_in_kmock(emulator):
    import kubernetes

    api = kubernetes.client.DiscoveryV1Api(emulator)
    create = lambda body: api.create_namespaced_endpoint_slice("ns", body)  # noqa: E731
    create(_slice("llama-abc", "llama", [("10.0.0.1", READY)]))
    create(_slice("other-xyz", "other", [("10.9.9.9", READY)]))  # another Service: ignored

    pushes: list[tuple[set[str], set[str]]] = []
    watcher = EndpointSliceWatcher("ns", "llama", "http", api_client=emulator, watch_timeout_s=0, retry_s=0.2)
    thread = threading.Thread(target=watcher.run_blocking, args=(lambda r, d: pushes.append((r, d)),), daemon=True)
    thread.start()

    def wait_for(expected: tuple[set[str], set[str]]) -> None:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if pushes and pushes[-1] == expected:
                return
            time.sleep(0.05)
        raise AssertionError(f"watcher never pushed {expected}; got {pushes}")

    try:
        wait_for(({"http://10.0.0.1:8000"}, set()))
        # a second pod becomes ready (new slice), then the first starts terminating
        create(_slice("llama-def", "llama", [("10.0.0.2", READY)]))
        wait_for(({"http://10.0.0.1:8000", "http://10.0.0.2:8000"}, set()))
        api.patch_namespaced_endpoint_slice(
            "llama-abc", "ns", {"endpoints": [{"addresses": ["10.0.0.1"], "conditions": TERMINATING}]}
        )
        wait_for(({"http://10.0.0.2:8000"}, {"http://10.0.0.1:8000"}))
        api.delete_namespaced_endpoint_slice("llama-abc", "ns")
        wait_for(({"http://10.0.0.2:8000"}, set()))
    finally:
        watcher.stop()
        thread.join(10)  # the emulator ignores timeoutSeconds: the client's 5 s read timeout ends the watch


def test_watcher_reads_pd_roles_from_the_pods_llm_d_label_in_kmock(emulator):
    import kubernetes

    api = kubernetes.client.DiscoveryV1Api(emulator)
    core = kubernetes.client.CoreV1Api(emulator)

    def pod(name: str, ip: str, role: str | None) -> dict:
        labels = {"app": "llama", **({"llm-d.ai/role": role} if role else {})}
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "ns", "labels": labels},
            "spec": {"containers": [{"name": "engine", "image": "kvserve"}]},
            "status": {"podIP": ip},
        }

    core.create_namespaced_pod("ns", pod("p-0", "10.0.0.1", "prefill"))
    core.create_namespaced_pod("ns", pod("d-0", "10.0.0.2", "decode"))
    api.create_namespaced_endpoint_slice("ns", _slice("llama-abc", "llama", [("10.0.0.1", READY), ("10.0.0.2", READY)]))
    pushes: list[tuple] = []
    watcher = EndpointSliceWatcher(
        "ns", "llama", "http", api_client=emulator, watch_timeout_s=0, retry_s=0.2, role_label="llm-d.ai/role"
    )
    thread = threading.Thread(target=watcher.run_blocking, args=(lambda *a: pushes.append(a),), daemon=True)
    thread.start()

    def wait_for(expected: tuple) -> None:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if pushes and pushes[-1] == expected:
                return
            time.sleep(0.05)
        raise AssertionError(f"watcher never pushed {expected}; got {pushes}")

    try:
        both = {"http://10.0.0.1:8000", "http://10.0.0.2:8000"}
        wait_for((both, set(), {"http://10.0.0.1:8000": "prefill", "http://10.0.0.2:8000": "decode"}))
        # A new pod without the label serves both; the pods are listed again because its address is new.
        core.create_namespaced_pod("ns", pod("x-0", "10.0.0.3", None))
        api.create_namespaced_endpoint_slice("ns", _slice("llama-def", "llama", [("10.0.0.3", READY)]))
        wait_for(
            (
                both | {"http://10.0.0.3:8000"},
                set(),
                {"http://10.0.0.1:8000": "prefill", "http://10.0.0.2:8000": "decode", "http://10.0.0.3:8000": "both"},
            )
        )
    finally:
        watcher.stop()
        thread.join(10)

"""Where the replicas are: a fixed list (`--backend`), or a Service's EndpointSlices watched in-cluster.

`endpoints_from_slices` is pure. The watcher runs the kubernetes client's (blocking) list+watch in a thread
and hands each new endpoint set to the event loop; it never makes a network call to a replica itself.
Endpoint semantics follow discovery.k8s.io/v1: `ready` (nil = ready) takes new requests; `serving` and
`terminating` but not ready = draining (in-flight requests finish, nothing new is routed there, as
production-stack learnt in their #601); an address that disappears is removed at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable
from typing import Any, Callable

logger = logging.getLogger("kvserve.router")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def _url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}"


def endpoints_from_slices(slices: Iterable[dict], port_name: str | None = None) -> tuple[set[str], set[str]]:
    """(ready URLs, draining URLs) from EndpointSlice dicts (camelCase, as the API serves them)."""
    ready: set[str] = set()
    draining: set[str] = set()
    for s in slices:
        ports = [p for p in s.get("ports") or [] if p.get("port")]
        if port_name is not None:
            ports = [p for p in ports if p.get("name") == port_name]
        if not ports:
            continue
        port = int(ports[0]["port"])
        for ep in s.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            is_ready = cond.get("ready") is not False  # nil means ready (discovery.k8s.io/v1)
            is_draining = not is_ready and cond.get("serving") is True and cond.get("terminating") is True
            for address in ep.get("addresses") or []:
                if not address:
                    continue  # an evicted pod can show up with no IP (production-stack #1008)
                if is_ready:
                    ready.add(_url(address, port))
                elif is_draining:
                    draining.add(_url(address, port))
    return ready, draining - ready


def static(urls: list[str]) -> Callable[[Any], Any]:
    async def run(router: Any) -> None:
        router.set_endpoints({u.rstrip("/") for u in urls})

    return run


class EndpointSliceWatcher:
    """List + watch the EndpointSlices of one Service; `push(ready, draining)` on every change (called on the
    event loop). Re-lists after any watch error or expiry, with a short back-off."""

    def __init__(
        self,
        namespace: str,
        service: str,
        port_name: str | None = "http",
        api_client: Any = None,
        watch_timeout_s: int = 60,
        retry_s: float = 2.0,
    ):
        self.namespace, self.service, self.port_name = namespace, service, port_name
        self.api_client = api_client
        self.watch_timeout_s, self.retry_s = watch_timeout_s, retry_s
        self._stop = threading.Event()

    async def __call__(self, router: Any) -> None:
        loop = asyncio.get_running_loop()

        def push(ready: set[str], draining: set[str]) -> None:
            loop.call_soon_threadsafe(router.set_endpoints, ready, draining)

        thread = threading.Thread(
            target=self.run_blocking, args=(push,), daemon=True, name=f"kvserve-router-endpointslices-{self.service}"
        )
        thread.start()
        try:
            await asyncio.Event().wait()  # until cancelled by Router.stop
        finally:
            self._stop.set()

    def stop(self) -> None:
        self._stop.set()

    def run_blocking(self, push: Callable[[set[str], set[str]], None]) -> None:
        import kubernetes

        if self.api_client is None:
            try:
                kubernetes.config.load_incluster_config()
            except kubernetes.config.ConfigException:
                kubernetes.config.load_kube_config()
            self.api_client = kubernetes.client.ApiClient()
        api = kubernetes.client.DiscoveryV1Api(self.api_client)
        selector = f"{SERVICE_NAME_LABEL}={self.service}"
        to_dict = self.api_client.sanitize_for_serialization
        last: tuple[set[str], set[str]] | None = None
        while not self._stop.is_set():
            try:
                listing = api.list_namespaced_endpoint_slice(self.namespace, label_selector=selector)
                slices = {item.metadata.name: to_dict(item) for item in listing.items}
                last = self._emit(slices, push, last)
                watch = kubernetes.watch.Watch()
                for event in watch.stream(
                    api.list_namespaced_endpoint_slice,
                    self.namespace,
                    label_selector=selector,
                    resource_version=listing.metadata.resource_version,
                    timeout_seconds=self.watch_timeout_s,
                    # a half-open connection must not freeze the endpoint set forever
                    _request_timeout=(10, self.watch_timeout_s + 5),
                ):
                    obj = to_dict(event["object"])
                    name = (obj.get("metadata") or {}).get("name")
                    if event["type"] == "DELETED":
                        slices.pop(name, None)
                    elif event["type"] in ("ADDED", "MODIFIED") and name:
                        slices[name] = obj
                    last = self._emit(slices, push, last)
                    if self._stop.is_set():
                        watch.stop()
            except Exception as exc:  # API down, 410 Gone, RBAC: keep the last known set and re-list
                logger.warning(
                    "EndpointSlice watch for %s/%s failed (%s); re-listing in %.0fs",
                    self.namespace,
                    self.service,
                    exc,
                    self.retry_s,
                )
                self._stop.wait(self.retry_s)

    def _emit(
        self,
        slices: dict[str, dict],
        push: Callable[[set[str], set[str]], None],
        last: tuple[set[str], set[str]] | None,
    ) -> tuple[set[str], set[str]]:
        # The label selector is applied again here: a slice relabelled away from the Service must go too.
        ours = [
            s
            for s in slices.values()
            if ((s.get("metadata") or {}).get("labels") or {}).get(SERVICE_NAME_LABEL) == self.service
        ]
        current = endpoints_from_slices(ours, self.port_name)
        if current != last:
            push(*current)
        return current

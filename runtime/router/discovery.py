"""Where the replicas are: a fixed list (`--backend`), or a Service's EndpointSlices watched in-cluster.

`endpoints_from_slices` is pure. The watcher runs the kubernetes client's (blocking) list+watch in a thread
and hands each new endpoint set to the event loop; it never makes a network call to a replica itself.
Endpoint semantics follow discovery.k8s.io/v1: `ready` (nil = ready) takes new requests; `serving` and
`terminating` but not ready = draining (in-flight requests finish, nothing new is routed there, as
production-stack learnt in their #601); an address that disappears is removed at once.

P/D mode: with a role label (llm-d's `llm-d.ai/role`), each endpoint's role is its pod's label value, read by
listing the namespace's pods that carry the label whenever an address appears that the last listing did not
cover (a pod's role is fixed when it is created). An address whose pod has no such label serves both; one
whose value is not a serving role (llm-d's `encode`) is left out.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable
from typing import Any, Callable
from urllib.parse import urlsplit

from kvserve.runtime.router.pd import BOTH, DECODE, PREFILL, role_from_label

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


def roles_from_pods(pods: Iterable[dict], label: str) -> dict[str, str | None]:
    """Pod IP -> role (pd.role_from_label of its `label`), from Pod dicts (camelCase, as the API serves them)."""
    roles: dict[str, str | None] = {}
    for pod in pods:
        value = ((pod.get("metadata") or {}).get("labels") or {}).get(label)
        status = pod.get("status") or {}
        ips = {status.get("podIP")} | {p.get("ip") for p in status.get("podIPs") or []}
        for ip in ips - {None, ""}:
            roles[ip] = role_from_label(value)
    return roles


def with_roles(
    ready: set[str], draining: set[str], roles_by_ip: dict[str, str | None]
) -> tuple[set[str], set[str], dict[str, str]]:
    """(ready, draining, URL -> role): unlabelled addresses serve both; unknown roles are dropped."""
    roles = {url: roles_by_ip.get(urlsplit(url).hostname or "", BOTH) for url in ready | draining}
    keep = {url for url, role in roles.items() if role is not None}
    return ready & keep, draining & keep, {url: roles[url] for url in keep}


def static(urls: list[str], prefill: list[str] = (), decode: list[str] = ()) -> Callable[[Any], Any]:
    """A fixed set: `urls` serve both roles, `prefill` only P legs, `decode` D legs and aggregated requests."""
    roles = {u.rstrip("/"): BOTH for u in urls}
    roles.update({u.rstrip("/"): PREFILL for u in prefill})
    roles.update({u.rstrip("/"): DECODE for u in decode})

    async def run(router: Any) -> None:
        router.set_endpoints(set(roles), roles=roles)

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
        role_label: str | None = None,  # P/D mode: the pods' role label, e.g. llm-d.ai/role
    ):
        self.namespace, self.service, self.port_name = namespace, service, port_name
        self.role_label = role_label
        self._roles_by_ip: dict[str, str | None] = {}
        self.api_client = api_client
        self.watch_timeout_s, self.retry_s = watch_timeout_s, retry_s
        self._stop = threading.Event()

    async def __call__(self, router: Any) -> None:
        loop = asyncio.get_running_loop()

        def push(ready: set[str], draining: set[str], roles: dict[str, str] | None = None) -> None:
            loop.call_soon_threadsafe(router.set_endpoints, ready, draining, roles)

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
        push: Callable[..., None],
        last: tuple | None,
    ) -> tuple:
        # The label selector is applied again here: a slice relabelled away from the Service must go too.
        ours = [
            s
            for s in slices.values()
            if ((s.get("metadata") or {}).get("labels") or {}).get(SERVICE_NAME_LABEL) == self.service
        ]
        current = endpoints_from_slices(ours, self.port_name)
        if self.role_label is not None:
            current = with_roles(*current, self._roles(current[0] | current[1]))
        if current != last:
            push(*current)
        return current

    def _roles(self, urls: set[str]) -> dict[str, str | None]:
        """Pod IP -> role, re-listing the labelled pods when an address is new since the last listing."""
        hosts = {urlsplit(u).hostname for u in urls}
        if hosts - set(self._roles_by_ip):
            import kubernetes

            core = kubernetes.client.CoreV1Api(self.api_client)
            pods = core.list_namespaced_pod(self.namespace, label_selector=self.role_label)
            found = roles_from_pods(
                (self.api_client.sanitize_for_serialization(p) for p in pods.items), self.role_label
            )
            # An address no labelled pod has serves both; remembered so it does not re-list on every event.
            self._roles_by_ip = {**{h: BOTH for h in hosts if h}, **found}
        return self._roles_by_ip

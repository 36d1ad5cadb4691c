"""Leader election on a coordination.k8s.io/v1 Lease, so several operator replicas never write at once.

Why a Lease and not kopf's peering: peering is built to pause deployed operators while a developer runs a
higher-priority one (kopf/_core/engines/peering.py). Replicas of one Deployment share one priority, and for
equal priorities kopf 1.45 pauses *all* of them ("Pausing all operators, including self"): two replicas
would reconcile nothing. Distinct priorities per replica would need per-pod configuration, and peering also
needs its own CRD (KopfPeering) installed. A Lease is what controller-runtime and client-go use: a built-in
API, optimistic concurrency on resourceVersion, and a takeover bound that follows from three numbers.

The algorithm is client-go's (leaderelection.go): a candidate acquires the Lease when nobody holds it or
when the record it last saw has not changed for leaseDurationSeconds *on its own clock* (so clock skew
between nodes does not matter); the holder renews every retry period and gives up when it could not renew
for renew_deadline (< lease duration, so it stops before anyone else may take over). Writes are merge
patches carrying the resourceVersion that was read, which the API server treats as a precondition (409 when
the Lease moved on): two candidates racing for a free Lease cannot both succeed.

Only the leader runs kopf at all (watches, handlers, resync): a standby holds no watch and sends nothing but
Lease reads. A leader that loses the Lease stops kopf and exits non-zero; the kubelet restarts the container
and it comes back as a candidate (client-go's `OnStoppedLeading` -> exit, for the same reason: no half-stopped
state). On SIGTERM the leader releases the Lease, so a rolling update hands over within one retry period.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvserve.operator import kube

log = logging.getLogger("kvserve.operator.leader")

# None: no election in this process (a single operator, tests); True/False: whether we hold the Lease now.
_leading: bool | None = None


def may_write() -> bool:
    """Whether this process may write to the cluster: always without election, else only while leading."""
    return _leading is not False


def default_identity() -> str:
    # POD_NAME (downward API) names the holder in `kubectl get lease`; the suffix keeps two processes apart.
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class LeaseSettings:
    name: str
    namespace: str
    identity: str
    lease_duration_s: int = 15  # client-go's defaults: 15 s lease, 10 s renew deadline, 2 s retry period
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError(
                "leader election needs 0 < retry period < renew deadline < lease duration, got "
                f"{self.retry_period_s}, {self.renew_deadline_s}, {self.lease_duration_s}"
            )

    @property
    def takeover_bound_s(self) -> float:
        """Worst case from the leader's crash to a standby holding the Lease: the standby sees the last
        renewal within one retry period, waits a lease duration, and notices expiry within one more."""
        return self.lease_duration_s + 2 * self.retry_period_s


def _micro_time() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Elector:
    """One candidate. `try_acquire_or_renew` is one round of the algorithm (blocking API calls)."""

    def __init__(self, settings: LeaseSettings, clock: Callable[[], float] = time.monotonic):
        self.settings, self._clock = settings, clock
        self._observed: tuple | None = None
        self._observed_at = 0.0
        self.leading = False
        self.holder = ""  # the holder in the last Lease record seen

    def _set(self, leading: bool) -> bool:
        global _leading
        if leading != self.leading:
            log.info(
                "%s %s the lease %s/%s",
                self.settings.identity,
                "acquired" if leading else "does not hold",
                self.settings.namespace,
                self.settings.name,
            )
        self.leading = _leading = leading
        return leading

    def _observe(self, spec: dict, now: float) -> None:
        record = tuple(spec.get(k) for k in ("holderIdentity", "renewTime", "leaseDurationSeconds", "leaseTransitions"))
        if record != self._observed:
            self._observed, self._observed_at = record, now
        self.holder = spec.get("holderIdentity") or ""

    def _body(self, spec: dict, resource_version: str | None) -> dict:
        meta = {"name": self.settings.name, "namespace": self.settings.namespace}
        if resource_version:
            meta["resourceVersion"] = resource_version  # a precondition: 409 if the Lease moved on
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}

    def _patch(self, spec: dict, lease: dict) -> None:
        body = self._body(spec, (lease.get("metadata") or {}).get("resourceVersion"))
        kube.request(
            "PATCH",
            kube.path("Lease", self.settings.namespace, self.settings.name),
            body,
            content_type="application/merge-patch+json",
        )

    def try_acquire_or_renew(self) -> bool:
        s, me, now = self.settings, self.settings.identity, self._clock()
        lease = kube.get("Lease", s.namespace, s.name)
        stamp = _micro_time()
        if lease is None:
            spec = {
                "holderIdentity": me,
                "leaseDurationSeconds": s.lease_duration_s,
                "acquireTime": stamp,
                "renewTime": stamp,
                "leaseTransitions": 0,
            }
            try:
                kube.request("POST", kube.path("Lease", s.namespace), self._body(spec, None))
            except kube.KubeError as exc:
                if exc.status == 409:  # another candidate created it first
                    return self._set(False)
                raise
            self._observe(spec, now)
            return self._set(True)
        spec = lease.get("spec") or {}
        self._observe(spec, now)
        holder = spec.get("holderIdentity") or ""
        duration = spec.get("leaseDurationSeconds") or s.lease_duration_s
        if holder and holder != me and now < self._observed_at + duration:
            return self._set(False)  # someone else holds a lease that has not expired on our clock
        new_spec = {
            "holderIdentity": me,
            "leaseDurationSeconds": s.lease_duration_s,
            "acquireTime": spec.get("acquireTime") if holder == me else stamp,
            "renewTime": stamp,
            "leaseTransitions": int(spec.get("leaseTransitions") or 0) + (0 if holder == me else 1),
        }
        try:
            self._patch(new_spec, lease)
        except kube.KubeError as exc:
            if exc.status == 409:  # lost the race for it
                return self._set(False)
            raise
        if holder != me:
            # A takeover: read it back. The real API server already refused a stale write above; an API without
            # optimistic concurrency (test emulators) lets two writers both "succeed" and keeps the last.
            check = (kube.get("Lease", s.namespace, s.name) or {}).get("spec") or {}
            if check.get("holderIdentity") != me:
                return self._set(False)
        self._observe(new_spec, now)
        return self._set(True)

    def release(self) -> None:
        """Hand the Lease back at shutdown (client-go's ReleaseOnCancel): a standby takes over at its next poll."""
        if not self.leading:
            return
        s = self.settings
        lease = kube.get("Lease", s.namespace, s.name)
        if lease is None or (lease.get("spec") or {}).get("holderIdentity") != s.identity:
            self._set(False)
            return
        stamp = _micro_time()
        spec = {**lease["spec"], "holderIdentity": "", "leaseDurationSeconds": 1, "renewTime": stamp}
        try:
            self._patch(spec, lease)
        except kube.KubeError as exc:
            log.warning("could not release the lease: %s", exc)
        self._set(False)


async def _keep_renewing(elector: Elector, lost: asyncio.Event) -> None:
    s = elector.settings
    last_renewal = time.monotonic()
    while True:
        await asyncio.sleep(s.retry_period_s)
        try:
            renewed: bool | None = await asyncio.to_thread(elector.try_acquire_or_renew)
        except Exception as exc:  # API unreachable: keep trying until the renew deadline
            log.warning("lease renewal failed: %s", exc)
            renewed = None
        if renewed:
            last_renewal = time.monotonic()
            continue
        taken = renewed is False and elector.holder not in ("", s.identity)  # someone else holds it now
        if taken or time.monotonic() - last_renewal > s.renew_deadline_s:
            log.error("lost the lease %s/%s: stopping the operator", s.namespace, s.name)
            elector._set(False)
            lost.set()
            return


async def _standby_health(endpoint: str):
    """While standing by, answer the liveness probe ourselves (kopf's endpoint starts with kopf)."""
    import urllib.parse

    from aiohttp import web

    url = urllib.parse.urlsplit(endpoint)

    async def ok(_: web.Request) -> web.Response:
        return web.json_response({"status": "standby"})

    app = web.Application()
    app.router.add_get(url.path or "/", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, url.hostname, url.port or 80, reuse_address=True).start()
    return runner


async def run_elected(
    elector: Elector, run_operator: Callable[[asyncio.Event], Awaitable[None]], liveness_endpoint: str | None = None
) -> int:
    """Stand by until `elector` holds the Lease, then run `run_operator(stop_flag)` while renewing it.

    Returns 0 after a clean stop (SIGTERM/SIGINT, Lease released) and 1 when the Lease was lost.
    """
    global _leading
    _leading = False
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    health = await _standby_health(liveness_endpoint) if liveness_endpoint else None
    try:
        log.info(
            "%s standing by for the lease %s/%s",
            elector.settings.identity,
            elector.settings.namespace,
            elector.settings.name,
        )
        while not stop.is_set():
            try:
                if await asyncio.to_thread(elector.try_acquire_or_renew):
                    break
            except Exception as exc:
                log.warning("lease acquisition failed: %s", exc)
            try:
                await asyncio.wait_for(stop.wait(), elector.settings.retry_period_s)
            except asyncio.TimeoutError:
                pass
        if stop.is_set():
            await asyncio.to_thread(elector.release)
            return 0
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)  # kopf installs its own
        if health is not None:
            await health.cleanup()
    lost = asyncio.Event()
    renewer = asyncio.create_task(_keep_renewing(elector, lost))
    try:
        await run_operator(lost)
    finally:
        renewer.cancel()
        if not lost.is_set():
            await asyncio.to_thread(elector.release)
    return 1 if lost.is_set() else 0

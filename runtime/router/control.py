"""The router's control loop: what it believes about each replica, kept current in the background.

Scrape every routable replica's /metrics and /v1/models (load, KV usage, which names are LoRA adapters and
where they are served), eject a replica that fails (exponential back-off, in ReplicaSet), re-probe ejected
replicas' /health and re-admit the healthy ones, apply discovery's endpoint sets, and wake held requests once
a replica is ready. The data path (proxy.py) only reads this state and reports failures it sees (`eject`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx

from kvserve.runtime.router.config import RouterConfig
from kvserve.runtime.router.hold import HeldRequests
from kvserve.runtime.router.metrics import RouterMetrics
from kvserve.runtime.router.replica_metrics import parse_metrics
from kvserve.runtime.router.replica_models import ReplicaModels, parse_models
from kvserve.runtime.router.replicas import ReplicaSet

logger = logging.getLogger("kvserve.router")


class ReplicaControl:
    """Scrape, probe, eject, hold. `client` is the router's shared HTTP client, set once it has started."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics):
        self.config = config
        self.metrics = metrics
        self.replicas = ReplicaSet(config)
        self.held = (
            HeldRequests(config.max_held_requests, config.hold_timeout_s, on_change=metrics.held.set)
            if config.max_held_requests > 0
            else None
        )
        self.client: httpx.AsyncClient | None = None

    # ---- discovery -------------------------------------------------------------------------------------------
    def set_endpoints(
        self, ready: set[str], draining: set[str] = frozenset(), roles: dict[str, str] | None = None
    ) -> None:
        _, removed = self.replicas.set_endpoints(ready, draining, roles)
        for url in removed:  # drop the per-replica series of replicas that are gone
            for gauge in (self.metrics.in_flight, self.metrics.index_blocks):
                try:
                    gauge.remove(url)
                except KeyError:
                    pass
        self.update_replica_gauges()
        self.release_held()

    # ---- hold ------------------------------------------------------------------------------------------------
    async def wait_for_ready(self, model: str, deadline: float) -> float:
        """Hold until a replica is ready; the seconds held. Raises HoldRejected (full, timed out)."""
        return await self.held.wait(model, deadline, ready=lambda: bool(self.replicas.ready()))

    def release_held(self) -> None:
        """Forward the held requests, oldest first, once a replica is ready (called after every change that
        can make one ready: discovery, a successful re-probe, a scrape round)."""
        if self.held is not None and len(self.held) and self.replicas.ready():
            logger.info("a replica is ready: forwarding %d held requests", self.held.release())

    def update_replica_gauges(self) -> None:
        states = {"routable": 0, "ejected": 0, "draining": 0}
        for r in self.replicas.replicas.values():
            states["draining" if r.draining else "ejected" if r.ejected_until is not None else "routable"] += 1
            self.metrics.index_blocks.labels(r.url).set(self.replicas.index.size(r.url))
        for state, n in states.items():
            self.metrics.replicas.labels(state).set(n)

    # ---- background: scrape /metrics, re-probe ejected replicas ----------------------------------------------
    async def poll_forever(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:  # never let one bad scrape end the loop
                logger.exception("replica poll failed")
            await asyncio.sleep(self.config.poll_interval_s)

    async def poll_once(self) -> None:
        now = time.monotonic()
        scrape = [r.url for r in self.replicas.replicas.values() if r.ejected_until is None]
        probe = self.replicas.due_for_probe(now, eager=self.held is not None and len(self.held) > 0)
        await asyncio.gather(*(self._scrape(url) for url in scrape), *(self.probe(url) for url in probe))
        self.update_replica_gauges()
        self.release_held()

    async def _scrape(self, url: str) -> None:
        try:
            resp = await self.client.get(url + "/metrics", timeout=httpx.Timeout(2.0, connect=1.0))
            resp.raise_for_status()
            self.replicas.observe_metrics(url, parse_metrics(resp.text), time.monotonic())
        except httpx.ConnectError as exc:
            self.eject(url, "metrics_connect_error", exc)
            return
        except (httpx.HTTPError, ValueError) as exc:
            # A slow or odd answer is not a dead replica: its metrics just go stale (and count as saturated).
            logger.debug("scrape of %s failed: %s", url, exc)
        self.replicas.observe_models(url, await self._read_models(url))

    async def _read_models(self, url: str) -> ReplicaModels | None:
        """The replica's model cards (which names are LoRA adapters there); None when unreadable (loading,
        a 401 without --replica-api-key, not an OpenAI server): then it is not filtered out for any adapter."""
        headers = {"authorization": f"Bearer {self.config.replica_api_key}"} if self.config.replica_api_key else {}
        try:
            resp = await self.client.get(url + "/v1/models", headers=headers, timeout=httpx.Timeout(2.0, connect=1.0))
            resp.raise_for_status()
            return parse_models(resp.json())
        except (httpx.HTTPError, ValueError) as exc:
            logger.debug("reading %s/v1/models failed: %s", url, exc)
            return None

    async def probe(self, url: str) -> None:
        try:
            resp = await self.client.get(url + "/health", timeout=httpx.Timeout(2.0, connect=1.0))
            healthy = resp.status_code == 200
        except httpx.HTTPError:
            healthy = False
        if healthy:
            self.replicas.readmit(url)
            await self._scrape(url)  # without fresh metrics it would score as saturated until the next round
            self.release_held()
        else:
            self.replicas.probe_failed(url, time.monotonic())

    async def reprobe_ejected(self) -> bool:
        """Probe every ejected replica now, not at its back-off time; True when one is ready again.

        Why: every attempt of a request failed before a byte reached the client, and the replicas that could
        take it may only be waiting out an ejection back-off that grew while they restarted (up to
        eject_max_s). In a rolling restart that is the moment the last old replica stops while its restarted
        peer is up but not re-admitted yet (seen as a 502 in tests/server/test_rolling_restart.py under load).
        A request pays this at most once, bounded by the probe's own timeout."""
        ejected = [r.url for r in self.replicas.replicas.values() if r.ejected_until is not None]
        if not ejected:
            return False
        await asyncio.gather(*(self.probe(url) for url in ejected))
        return bool(self.replicas.ready())

    def eject(self, url: str, cause: str, detail: Any = None) -> None:
        if self.replicas.eject(url, time.monotonic(), f"{cause}: {detail}") is not None:
            self.metrics.ejections.labels(url, cause).inc()
            self.update_replica_gauges()

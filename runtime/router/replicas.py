"""The router's view of its replicas: discovered set, in-flight counts, last /metrics, ejection state.

No I/O here: the proxy feeds in scrape results, failures and discovery updates (with the time), and asks for
the routable set. Keeping the clock a parameter lets tests drive ejection and back-off deterministically.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from kvserve.runtime.router.config import RouterConfig
from kvserve.runtime.router.pd import BOTH, DECODE_CANDIDATES, PREFILL
from kvserve.runtime.router.prefix_index import PrefixIndex
from kvserve.runtime.router.replica_metrics import ReplicaMetrics
from kvserve.runtime.router.replica_models import ReplicaModels
from kvserve.runtime.router.scoring import ReplicaView, SessionTable

logger = logging.getLogger("kvserve.router")


@dataclass
class Replica:
    url: str
    in_flight: int = 0
    in_flight_prefill_tokens: int = 0  # uncached prompt tokens of the router's in-flight requests here
    metrics: ReplicaMetrics | None = None
    metrics_at: float | None = None  # monotonic time of the last good scrape
    ejected_until: float | None = None  # not routable before this time (then re-probed)
    ejections_in_a_row: int = 0
    draining: bool = False  # EndpointSlice says serving but terminating: finish, take nothing new
    models: ReplicaModels | None = None  # its last /v1/models (None: not read yet, or unreadable)
    in_flight_adapters: Counter[str] = field(default_factory=Counter)  # the router's requests there, by adapter
    role: str = BOTH  # P/D mode (router/pd.py): prefill, decode or both


class ReplicaSet:
    def __init__(self, config: RouterConfig | None = None):
        """The defaults, staleness and ejection back-off are RouterConfig's (default: RouterConfig())."""
        config = config if config is not None else RouterConfig()
        self.default_capacity_tokens = config.default_capacity_tokens
        self.default_block_size = config.default_block_size
        self.stale_after_s = config.stale_after_s
        self.eject_base_s, self.eject_max_s = config.eject_base_s, config.eject_max_s
        self.replicas: dict[str, Replica] = {}
        self.index = PrefixIndex()
        self.sessions = SessionTable()

    # ---- discovery ----------------------------------------------------------------------------------------
    def set_endpoints(
        self, ready: set[str], draining: set[str] = frozenset(), roles: dict[str, str] | None = None
    ) -> tuple[set[str], set[str]]:
        """Replace the discovered set; returns (added, removed). A removed replica loses its index entries,
        sessions and counters at once (a "ghost" endpoint would hang requests, production-stack #1008).
        `roles`: URL -> prefill | decode | both (P/D mode); a URL not in it serves both."""
        wanted = set(ready) | set(draining)
        added = wanted - set(self.replicas)
        removed = set(self.replicas) - wanted
        for url in added:
            self.replicas[url] = Replica(url)
        for url in removed:
            del self.replicas[url]
            self.index.drop(url)
            self.sessions.forget_replica(url)
        for url, replica in self.replicas.items():
            replica.draining = url in draining and url not in ready
            replica.role = (roles or {}).get(url, BOTH)
        if added or removed:
            logger.info("replicas: %s (added %s, removed %s)", sorted(self.replicas), sorted(added), sorted(removed))
        return added, removed

    # ---- observations ---------------------------------------------------------------------------------------
    def observe_metrics(self, url: str, metrics: ReplicaMetrics, now: float) -> None:
        replica = self.replicas.get(url)
        if replica is None:
            return
        replica.metrics, replica.metrics_at = metrics, now
        self.index.ensure(url, self.capacity_blocks(replica))

    def observe_models(self, url: str, models: ReplicaModels | None) -> None:
        replica = self.replicas.get(url)
        if replica is not None:
            replica.models = models

    def adapter_names(self) -> set[str]:
        """Every model name some replica serves as a LoRA adapter (from /v1/models or its metric)."""
        names: set[str] = set()
        for r in self.replicas.values():
            if r.models is not None:
                names |= r.models.adapters
            if r.metrics is not None:
                names |= r.metrics.running_adapters | r.metrics.waiting_adapters
        return names

    def eject(self, url: str, now: float, cause: str) -> float | None:
        """Take a failing replica out of rotation with exponential back-off; returns the back-off in seconds
        (None for an unknown or already ejected replica). Its index entries go: a replica that restarts comes
        back with an empty cache."""
        replica = self.replicas.get(url)
        if replica is None or replica.ejected_until is not None:
            return None
        backoff = min(self.eject_max_s, self.eject_base_s * 2**replica.ejections_in_a_row)
        replica.ejected_until = now + backoff
        replica.ejections_in_a_row += 1
        replica.metrics = replica.metrics_at = replica.models = None
        self.index.drop(url)
        self.sessions.forget_replica(url)
        logger.warning("ejected %s for %.1fs: %s", url, backoff, cause)
        return backoff

    def due_for_probe(self, now: float, eager: bool = False) -> list[str]:
        """Ejected replicas whose back-off is over; with `eager` (requests are held waiting for a replica)
        every ejected one, so a replica that finished loading is found within one poll, not after a back-off
        of up to eject_max_s."""
        return [
            r.url for r in self.replicas.values() if r.ejected_until is not None and (eager or now >= r.ejected_until)
        ]

    def probe_failed(self, url: str, now: float) -> None:
        replica = self.replicas.get(url)
        if replica is not None and replica.ejected_until is not None:
            backoff = min(self.eject_max_s, self.eject_base_s * 2**replica.ejections_in_a_row)
            replica.ejected_until = now + backoff
            replica.ejections_in_a_row += 1

    def readmit(self, url: str) -> bool:
        replica = self.replicas.get(url)
        if replica is None or replica.ejected_until is None:
            return False
        replica.ejected_until = None
        logger.info("re-admitted %s", url)
        return True

    def served(self, url: str) -> None:
        """A response came back: the replica is healthy again, reset its back-off."""
        replica = self.replicas.get(url)
        if replica is not None and replica.ejected_until is None:
            replica.ejections_in_a_row = 0

    # ---- queries --------------------------------------------------------------------------------------------
    def block_size(self, replica: Replica) -> int:
        return replica.metrics.block_size if replica.metrics and replica.metrics.block_size else self.default_block_size

    def capacity_blocks(self, replica: Replica) -> int:
        tokens = (
            replica.metrics.capacity_tokens
            if replica.metrics and replica.metrics.capacity_tokens
            else self.default_capacity_tokens
        )
        return max(1, tokens // self.block_size(replica))

    def pd_active(self) -> bool:
        """P/D mode: some replica is a prefill replica."""
        return any(r.role == PREFILL for r in self.replicas.values())

    def routable(self, now: float, roles: frozenset[str] | None = None) -> list[Replica]:
        """Healthy, non-draining replicas; if every one is ejected, all non-draining ones (fail open: a
        wrong ejection must not turn into a full outage). Draining: the EndpointSlice says terminating, or
        the replica's last scrape said `kvserve:draining 1` (a stop signal came: the router stops sending
        first, while the replica still accepts through its preStop sleep or --drain-accept-seconds). `roles`:
        only replicas of these roles (P/D mode), the fail-open applying among them."""
        live = [r for r in self._live() if roles is None or r.role in roles]
        healthy = [r for r in live if r.ejected_until is None]
        return healthy or live

    def ready(self) -> list[Replica]:
        """Healthy, non-draining replicas that can serve a whole request (not prefill-only), without
        routable()'s fail-open: what held requests wait for."""
        return [r for r in self._live() if r.ejected_until is None and r.role in DECODE_CANDIDATES]

    def _live(self) -> list[Replica]:
        return [r for r in self.replicas.values() if not (r.draining or (r.metrics is not None and r.metrics.draining))]

    def view(self, replica: Replica, now: float) -> ReplicaView:
        fresh = (
            replica.metrics is not None
            and replica.metrics_at is not None
            and now - replica.metrics_at <= self.stale_after_s
        )
        m = replica.metrics if fresh else None
        in_flight_adapters = frozenset(name for name, n in replica.in_flight_adapters.items() if n > 0)
        return ReplicaView(
            url=replica.url,
            in_flight=replica.in_flight,
            waiting=m.waiting if m else None,
            running=m.running if m else None,
            kv_usage=m.kv_usage if m else None,
            block_size=self.block_size(replica),
            in_flight_prefill_tokens=replica.in_flight_prefill_tokens,
            adapters=replica.models.adapters if replica.models is not None else None,
            running_adapters=(m.running_adapters if m else frozenset()) | in_flight_adapters,
            waiting_adapters=m.waiting_adapters if m else frozenset(),
            max_loras=m.max_loras if m else None,
        )

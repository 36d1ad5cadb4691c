"""Subscribe to every replica's KV events and keep the router's KVEventIndex (kv_index.py) in step with them.

One asyncio task per replica (zmq.asyncio, on the router's loop, so the index needs no lock): a SUB socket on
the replica's event endpoint, and, when it has one, a DEALER for its replay endpoint. Per message:
- the next sequence number: applied;
- a gap (a sequence skipped: ZMQ's high-water mark dropped messages, or the publisher dropped a batch): the
  missing batches are asked for by replay and applied in order; if the replay cannot supply them (no replay
  endpoint, no answer, or history older than its buffer), the replica resyncs;
- a sequence at or below the last one: the publisher restarted (its sequence starts at 0 per lifetime), so
  the engine's cache was emptied: the replica resyncs;
- the first message after a (re)subscription: the batches before it are replayed from sequence 0.
A resync clears the replica's blocks and replays from 0; what the publisher no longer buffers is lost, which
the index marks (`partial`): it then under-reports, never over-reports. kvserve's heartbeats (empty batches
every second while idle) repeat the last batch's sequence number: they refresh the stream's age and, one
beyond the last batch seen, reveal a missed batch at once rather than at the next real one.

While a replica's stream is not synced, or silent for longer than stale_after_s (the engine publishes an empty
batch every second when idle), the router scores it from its estimate (kv_index.PreciseOrEstimate): a dead
event stream costs precision, never a request.

Where each replica's events are: `EventEndpoints` -- explicit per-replica endpoints (`--kv-events-endpoint
URL=tcp://host:port[,tcp://host:replay_port]`) or, for discovered replicas, the replica's host with a fixed
port (`--kv-events-port`, `--kv-events-replay-port`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from kvserve.runtime.kv_events.events import DecodedBatch, MalformedEvent, decode_batch
from kvserve.runtime.router.kv_index import KVEventIndex, PreciseOrEstimate

logger = logging.getLogger("kvserve.router")

END_SEQ = -1


@dataclass(frozen=True)
class EventSource:
    endpoint: str
    replay_endpoint: str | None = None


@dataclass
class EventEndpoints:
    """Replica URL -> where its events are published."""

    explicit: dict[str, EventSource] = field(default_factory=dict)
    port: int | None = None  # discovered replicas: tcp://<replica host>:<port>
    replay_port: int | None = None
    topic: str = ""  # subscription prefix (vLLM consumers filter on it; llm-d uses "kv@")

    def source(self, url: str) -> EventSource | None:
        if url in self.explicit:
            return self.explicit[url]
        if self.port is None:
            return None
        host = urlsplit(url).hostname
        if not host:
            return None
        host = f"[{host}]" if ":" in host else host
        replay = f"tcp://{host}:{self.replay_port}" if self.replay_port else None
        return EventSource(f"tcp://{host}:{self.port}", replay)

    @staticmethod
    def parse_explicit(items: list[str]) -> dict[str, EventSource]:
        """`URL=tcp://h:p` or `URL=tcp://h:p,tcp://h:replay_port` -> {URL: EventSource}; ValueError naming the
        item otherwise."""
        out = {}
        for item in items:
            url, sep, rest = item.partition("=")
            parts = [p.strip() for p in rest.split(",")] if sep else []
            if not url or not parts or len(parts) > 2 or not all(p.startswith(("tcp://", "ipc://")) for p in parts):
                raise ValueError(
                    f"--kv-events-endpoint {item!r}: expected REPLICA_URL=tcp://host:port[,tcp://host:replay_port] "
                    "(or ipc:// paths)"
                )
            out[url.rstrip("/")] = EventSource(parts[0], parts[1] if len(parts) > 1 else None)
        return out


class ReplicaSubscriber:
    """The event stream of one replica."""

    def __init__(
        self,
        url: str,
        source: EventSource,
        index: KVEventIndex,
        ctx: zmq.asyncio.Context,
        topic: str = "",
        replay_timeout_s: float = 2.0,
        metrics: Any = None,
    ):
        self.url, self.source, self.index, self.ctx = url, source, index, ctx
        self.topic = topic
        self.replay_timeout_s = replay_timeout_s
        self.metrics = metrics
        self.last_seq: int | None = None
        self.resyncs = 0
        self.replays = 0
        self.malformed = 0

    @property
    def state(self):
        return self.index.replica(self.url)

    async def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)  # drops happen at the publisher's HWM, where the sequence shows them
        sub.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.source.endpoint)
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.malformed += 1
                    continue
                await self.on_message(int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sub.close()

    async def on_message(self, seq: int, payload: bytes) -> None:
        state = self.state
        state.last_message_at = time.monotonic()
        try:
            batch = decode_batch(payload)
        except MalformedEvent as exc:
            logger.warning("KV events of %s: batch %d malformed (%s): resyncing at the next batch", self.url, seq, exc)
            self.malformed += 1
            state.synced, state.resync_requested = False, True
            return
        # kvserve's heartbeat (an empty batch) repeats the last batch's sequence number. An empty batch one
        # beyond it is a batch this subscriber missed (or a heartbeat that took a number of its own): both are
        # checked against the replay, like any gap.
        heartbeat = not batch.events
        last = self.last_seq
        if last is not None and not state.resync_requested:
            if seq == last + 1 and not heartbeat:
                self._apply(seq, batch)
                return
            if heartbeat and seq == last:
                return
        through = seq if heartbeat else seq - 1  # the last batch that must be applied before this message
        if state.resync_requested or last is None:
            if state.resync_requested:
                state.resync_requested = False
                self.resyncs += 1
                self._count("resync_ejected")
            await self._catch_up(through + 1)
        elif through < last:
            logger.info("KV events of %s: sequence went back %d -> %d: publisher restarted", self.url, last, seq)
            await self._resync(through + 1, "restart")
        else:
            await self._fill_gap(through + 1)
        if heartbeat and self.last_seq is None and through >= 0:
            return  # the batches up to `through` could not be replayed: wait for the next real batch
        self._apply(seq, batch)

    def _apply(self, seq: int, batch: DecodedBatch | bytes) -> None:
        if isinstance(batch, bytes):
            try:
                batch = decode_batch(batch)
            except MalformedEvent as exc:
                logger.warning("KV events of %s: replayed batch %d malformed (%s)", self.url, seq, exc)
                self.malformed += 1
                return
        self.state.apply(batch)
        self.last_seq = seq
        self.state.synced = True

    async def _fill_gap(self, seq: int) -> None:
        want = self.last_seq + 1
        replayed = await self._replay(want)
        missing = [(s, p) for s, p in (replayed or []) if s < seq]
        if [s for s, _ in missing] == list(range(want, seq)):
            self._count("gap_replayed")
            for s, payload in missing:
                self._apply(s, payload)
            return
        logger.info("KV events of %s: batches %d..%d lost and not replayable: resyncing", self.url, want, seq - 1)
        await self._resync(seq, "gap")

    async def _resync(self, seq: int, cause: str) -> None:
        self.resyncs += 1
        self._count(f"resync_{cause}")
        await self._catch_up(seq)

    async def _catch_up(self, seq: int) -> None:
        """Before applying batch `seq`: start from an empty index and replay batches 0..seq-1 (a publisher's
        whole history, while its buffer still holds it)."""
        state = self.state
        state.clear()
        state.synced = False
        self.last_seq = None
        if seq == 0:
            state.partial = False
            return
        replayed = await self._replay(0)
        before = [(s, p) for s, p in (replayed or []) if s < seq]
        for s, payload in before:
            self._apply(s, payload)
        state.partial = [s for s, _ in before] != list(range(seq))

    async def _replay(self, start_seq: int) -> list[tuple[int, bytes]] | None:
        """The publisher's buffered batches from start_seq; None when it does not answer in time."""
        if self.source.replay_endpoint is None:
            return None
        self.replays += 1
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.source.replay_endpoint)
        out: list[tuple[int, bytes]] = []
        try:
            await sock.send_multipart((b"", start_seq.to_bytes(8, "big")))
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not await sock.poll(int(remaining * 1000)):
                    logger.info("KV events of %s: replay from %d timed out", self.url, start_seq)
                    return None
                frames = await sock.recv_multipart()
                if len(frames) != 3:
                    continue
                _, seq_bytes, payload = frames
                if not payload and int.from_bytes(seq_bytes, "big", signed=True) == END_SEQ:
                    return out
                out.append((int.from_bytes(seq_bytes, "big"), payload))
        finally:
            sock.close()

    def _count(self, what: str) -> None:
        if self.metrics is not None:
            self.metrics.kv_events_recoveries.labels(self.url, what).inc()


class KVEventSubscriptions:
    """All replicas' subscribers, kept in step with the router's replica set, and the index they feed."""

    def __init__(self, endpoints: EventEndpoints, stale_after_s: float = 5.0, sync_interval_s: float = 1.0):
        self.endpoints = endpoints
        self.index = KVEventIndex(stale_after_s)
        self.sync_interval_s = sync_interval_s
        self.subscribers: dict[str, tuple[ReplicaSubscriber, asyncio.Task]] = {}
        self.ctx: zmq.asyncio.Context | None = None
        self.metrics: Any = None

    def index_over(self, estimate) -> PreciseOrEstimate:
        """The prefix index the router scores with: these events where fresh, `estimate` elsewhere."""
        return PreciseOrEstimate(estimate, self.index)

    def sync(self, urls: set[str]) -> None:
        if self.ctx is None:
            self.ctx = zmq.asyncio.Context()
        for url in set(self.subscribers) - urls:
            _, task = self.subscribers.pop(url)
            task.cancel()
            self.index.forget(url)
        for url in urls - set(self.subscribers):
            source = self.endpoints.source(url)
            if source is None:
                continue
            sub = ReplicaSubscriber(url, source, self.index, self.ctx, self.endpoints.topic, metrics=self.metrics)
            self.subscribers[url] = (sub, asyncio.create_task(self._guard(sub)))

    async def _guard(self, sub: ReplicaSubscriber) -> None:
        while True:
            try:
                await sub.run()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 -- never let one replica's stream end its subscription
                logger.exception("KV event subscriber of %s failed; restarting it", sub.url)
                sub.last_seq = None
                sub.state.synced = False
                await asyncio.sleep(1.0)

    async def run(self, router) -> None:
        """Follow the router's replica set (discovery adds and removes replicas) until cancelled."""
        self.metrics = _register_metrics(router.metrics.registry)
        try:
            while True:
                self.sync(set(router.replicas.replicas))
                self._observe()
                await asyncio.sleep(self.sync_interval_s)
        finally:
            await self.close()

    async def close(self) -> None:
        tasks = [task for _, task in self.subscribers.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.subscribers.clear()
        if self.ctx is not None:
            self.ctx.destroy(linger=0)
            self.ctx = None

    def _observe(self) -> None:
        if self.metrics is None:
            return
        now = time.monotonic()
        for url in self.subscribers:
            state = self.index.replicas.get(url)
            age = now - state.last_message_at if state is not None and state.last_message_at is not None else -1.0
            self.metrics.kv_events_age.labels(url).set(age)
            self.metrics.kv_events_fresh.labels(url).set(1.0 if self.index.is_fresh(url, now) else 0.0)
            self.metrics.kv_events_blocks.labels(url).set(len(state.blocks) if state is not None else 0)


@dataclass
class _Metrics:
    kv_events_age: Any
    kv_events_fresh: Any
    kv_events_blocks: Any
    kv_events_recoveries: Any


def _register_metrics(registry) -> _Metrics:
    from prometheus_client import Counter, Gauge

    return _Metrics(
        Gauge(
            "kvserve_router:kv_events_age_seconds",
            "Seconds since the replica's last KV-event message (-1: none yet).",
            ["replica"],
            registry=registry,
        ),
        Gauge(
            "kvserve_router:kv_events_fresh",
            "1 while the replica is scored from its KV events, 0 while from the router's estimate.",
            ["replica"],
            registry=registry,
        ),
        Gauge(
            "kvserve_router:kv_events_blocks",
            "Blocks the replica's KV events say it holds.",
            ["replica"],
            registry=registry,
        ),
        Counter(
            "kvserve_router:kv_events_recoveries",
            "Gaps replayed and resyncs (gap, restart, ejected) of the replica's KV-event stream.",
            ["replica", "what"],
            registry=registry,
        ),
    )

"""Routing decisions as a pure function: (request features, replica snapshots, prefix index) -> ranked replicas.

Modelled on llm-d's scheduler: each scorer yields a value in [0, 1], multiplied by its weight and summed per
replica; the best total wins, ties broken at random. The whole ranking is returned, so a retry walks on to
the next best replica without scoring again, and an ext_proc endpoint picker can return the same list as
Envoy's fallback order. No I/O, no clocks, no asyncio: callers pass snapshots in.

Scorers (weights in `Weights`, documented in docs/router.md):
- prefill: prompt work on the replica, in tokens -- this prompt's uncached part there, plus the uncached
  prompt tokens of the router's requests in flight there (held until they end: the router cannot see when a
  replica finishes a prefill without parsing the stream). Scored 1 for the least such work, falling
  linearly by 1/prefill_scale per extra token. This is how a cached prefix pays (in prefill work saved) and how it
  stops paying on a
  replica already busy prefilling ("sticky until saturated", in tokens rather than request counts).
- prefix: the fraction of the prompt's full blocks that the replica is believed to hold (longest cached
  prefix, from the PrefixIndex): a small tie-breaker towards locality.
  Both prefix terms are 0 on a replica whose load exceeds the least-loaded one's by more than
  `max_imbalance` requests: a hot prefix must not pile every request on one replica.
- queue: load = max(router's in-flight requests there, replica's waiting + running from /metrics); scored
  1 for the least-loaded replica, falling linearly by 1/queue_scale per request of extra load (decode work).
- kv: 1 - the replica's KV-cache usage; 0 when its metrics are stale (unknown pressure counts as full).
- session: 1 on the replica this session was last sent to (optional, keyed by a request header).
- adapter (a request for a LoRA adapter): first a filter -- only replicas that serve the adapter (their
  /v1/models lists it, or their metric names it), all of them if none is known to (fail open: the replica
  answers the 404) --, then the Gateway API Inference Extension's lora-affinity values: 1 where the adapter is
  running (vllm:lora_requests_info, or the router's own requests in flight there: the metric lags a scrape),
  0.8 where a slot is free (fewer adapters running or waiting than max_lora: it loads without waiting for
  one), 0.6 where it is waiting, else 0 (it waits for a slot). 0 on a saturated replica, as prefix affinity.
  Prefix hashes of an adapter's prompts are chained from a seed of its name: the engine keys KV blocks by
  adapter, so a prompt cached under the base model or another adapter is no hit.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvserve.runtime import engine_args
from kvserve.runtime.core.block_hash import NONE_HASH, extend_block_hashes, root_hash
from kvserve.runtime.router.prefix_index import PrefixIndex


@dataclass(frozen=True)
class Weights:
    prefill: float = 3.0
    prefix: float = 1.0
    queue: float = 2.0
    kv: float = 1.0
    session: float = 4.0
    adapter: float = 3.0
    prefill_scale: float = 2048.0  # prompt tokens of extra prefill work that cost the whole prefill weight
    queue_scale: float = 8.0  # requests of extra load that cost the whole queue weight
    max_imbalance: int = 8  # requests above the least-loaded replica beyond which prefix affinity is ignored

    def __post_init__(self) -> None:
        for name in ("prefill", "prefix", "queue", "kv", "session", "adapter"):
            if getattr(self, name) < 0:
                raise ValueError(f"weight {name} must be >= 0, got {getattr(self, name)}")
        for name in ("prefill_scale", "queue_scale"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows about one routable replica at decision time."""

    url: str
    in_flight: int = 0
    waiting: int | None = None  # None: no fresh /metrics
    running: int | None = None
    kv_usage: float | None = None  # 0..1
    block_size: int = engine_args.default("block_size")  # the replica's; unreported: the engine's default
    in_flight_prefill_tokens: int = 0  # uncached prompt tokens of the router's in-flight requests there
    adapters: frozenset[str] | None = None  # LoRA adapters it lists in /v1/models; None: not known
    running_adapters: frozenset[str] = frozenset()  # from its metric plus the router's in-flight requests
    waiting_adapters: frozenset[str] = frozenset()
    max_loras: int | None = None  # None: no fresh LoRA metric

    def serves(self, adapter: str) -> bool:
        return adapter in self.running_adapters or adapter in self.waiting_adapters or adapter in (self.adapters or ())

    def adapter_affinity(self, adapter: str) -> float:
        if adapter in self.running_adapters:
            return 1.0
        if self.max_loras is not None and len(self.running_adapters | self.waiting_adapters) < self.max_loras:
            return 0.8
        return 0.6 if adapter in self.waiting_adapters else 0.0

    @property
    def load(self) -> int:
        # The router's own count reacts instantly; the replica's gauges also see other routers' traffic.
        reported = (self.waiting or 0) + (self.running or 0)
        return max(self.in_flight, reported)


@dataclass(frozen=True)
class RequestFeatures:
    """`hashes_for(block_size)` returns the prompt's chained block hashes at that block size (callers memoise);
    None when the prompt could not be tokenised (then only load decides)."""

    hashes_for: Callable[[int], Sequence[bytes]] | None = None
    num_prompt_tokens: int = 0
    session_url: str | None = None  # where this session went last, if session affinity is on
    adapter: str | None = None  # the LoRA adapter the request names as its model (None: the base model)


@dataclass(frozen=True)
class Score:
    url: str
    total: float
    prefill: float
    prefix: float
    queue: float
    kv: float
    session: float
    adapter: float
    matched_blocks: float  # tier-weighted when the replica is scored from its KV events
    total_blocks: int
    load: int
    uncached_tokens: int  # this request's prompt tokens the replica would prefill


@dataclass(frozen=True)
class Decision:
    ranked: list[Score]
    reason: str  # why ranked[0] won: "adapter", "prefix", "session", "load" or "only"

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.ranked]

    def describe(self) -> str:
        return "; ".join(
            f"{s.url} total={s.total:.2f} prefill={s.prefill:.2f}({s.uncached_tokens} uncached) "
            f"prefix={s.prefix:.2f}({s.matched_blocks}/{s.total_blocks}) "
            f"queue={s.queue:.2f}(load {s.load}) kv={s.kv:.2f} session={s.session:.0f} adapter={s.adapter:.1f}"
            for s in self.ranked
        )


def rank(
    features: RequestFeatures,
    replicas: Sequence[ReplicaView],
    index: PrefixIndex,  # or anything with matched_blocks(url, hashes), e.g. kv_index.PreciseOrEstimate
    weights: Weights,
    rng: random.Random | None = None,
) -> Decision:
    if not replicas:
        return Decision([], "none")
    rng = rng or random
    if features.adapter is not None:
        replicas = [r for r in replicas if r.adapters is None or r.serves(features.adapter)] or replicas
    loads = [r.load for r in replicas]
    min_load, max_load = min(loads), max(loads)
    span = max(float(max_load - min_load), weights.queue_scale)
    rows = []
    for r in replicas:
        matched = total = 0
        if features.hashes_for is not None:
            hashes = features.hashes_for(r.block_size)
            total = len(hashes)
            matched = index.matched_blocks(r.url, hashes) if total else 0
        saturated = r.load - min_load > weights.max_imbalance
        if saturated:
            matched = 0
        # matched may be fractional: the event index weights blocks by their tier (router/kv_index.py)
        uncached = max(0, features.num_prompt_tokens - int(matched * r.block_size))
        adapter = 0.0
        if features.adapter is not None and not saturated:
            adapter = r.adapter_affinity(features.adapter)
        rows.append((r, matched, total, uncached, r.in_flight_prefill_tokens + uncached, adapter))
    works = [row[4] for row in rows]
    work_span = max(float(max(works) - min(works)), weights.prefill_scale)
    scores = []
    for r, matched, total, uncached, work, adapter in rows:
        prefill = 1.0 - (work - min(works)) / work_span
        prefix = matched / total if total else 0.0
        queue = 1.0 - (r.load - min_load) / span
        kv = 1.0 - min(1.0, max(0.0, r.kv_usage)) if r.kv_usage is not None else 0.0
        session = 1.0 if features.session_url == r.url else 0.0
        total_score = (
            weights.prefill * prefill
            + weights.prefix * prefix
            + weights.queue * queue
            + weights.kv * kv
            + weights.session * session
            + weights.adapter * adapter
        )
        scores.append(
            Score(r.url, total_score, prefill, prefix, queue, kv, session, adapter, matched, total, r.load, uncached)
        )
    rng.shuffle(scores)  # random tie-break: the sort below is stable
    scores.sort(key=lambda s: s.total, reverse=True)
    return Decision(scores, _reason(scores, weights))


def _reason(scores: list[Score], weights: Weights) -> str:
    if len(scores) == 1:
        return "only"
    best, rest = scores[0], scores[1:]
    if best.session and weights.session:
        return "session"
    if weights.adapter and best.adapter > max(s.adapter for s in rest):
        return "adapter"
    if best.prefix > 0 and best.prefix > max(s.prefix for s in rest):
        return "prefix"
    return "load"


class SessionTable:
    """Bounded map session key -> replica URL last used (LRU), for optional session affinity."""

    def __init__(self, max_sessions: int = 100_000):
        self.max_sessions = max_sessions
        self._table: OrderedDict[str, str] = OrderedDict()

    def get(self, key: str | None) -> str | None:
        if key is None:
            return None
        url = self._table.get(key)
        if url is not None:
            self._table.move_to_end(key)
        return url

    def put(self, key: str | None, url: str) -> None:
        if key is None:
            return
        self._table[key] = url
        self._table.move_to_end(key)
        while len(self._table) > self.max_sessions:
            self._table.popitem(last=False)

    def forget_replica(self, url: str) -> None:
        for key in [k for k, v in self._table.items() if v == url]:
            del self._table[key]


@dataclass
class HashCache:
    """A prompt's block hashes, computed once per block size (replicas may differ). Only the first
    `max_tokens` tokens are hashed: matching beyond that buys little and costs router CPU (llm-d caps at 128K)."""

    token_ids: Sequence[int]
    max_tokens: int = 131_072
    adapter: str | None = None  # a LoRA adapter's prompts get a chain of their own (adapter_root)
    _by_size: dict[int, list[bytes]] = field(default_factory=dict)

    def __call__(self, block_size: int) -> list[bytes]:
        if block_size not in self._by_size:
            root = adapter_root(self.adapter)
            self._by_size[block_size] = extend_block_hashes([], self.token_ids[: self.max_tokens], block_size, root)
        return self._by_size[block_size]


def adapter_root(adapter: str | None) -> bytes:
    """The router's chain seed for an adapter's prompts. Seeded by the adapter's name (llm-d seeds by model
    name): the router cannot see the content identity the engine keys on, and needs no more -- its index is
    its own guess, compared only with itself. A reload under the same name is a miss at the engine, which
    costs one prefill, never a wrong answer."""
    return root_hash("router-adapter-name:" + adapter) if adapter else NONE_HASH

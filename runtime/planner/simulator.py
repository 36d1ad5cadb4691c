"""Discrete-event simulation of one replica: the real Scheduler and KVCacheManager (runtime/core, unchanged)
step on a simulated clock; each step advances it by the step-time model's prediction. Sampled tokens are
dummies and requests stop on max_tokens only (ignore_eos), so output lengths are exactly the workload's.

Arrivals: Poisson at request_rate (req/s), or closed loop with `concurrency` clients (each sends its next
request when the previous one finishes). Prefix sharing: the first prefix_len tokens of every prompt are
identical, so the prefix cache sees hits as the real engine would.
"""

from __future__ import annotations

import functools
import heapq
import json
import math
import random
from dataclasses import dataclass, field
from typing import NamedTuple

from kvserve.runtime import engine_args
from kvserve.runtime.core.block_pool import KVCacheBlock
from kvserve.runtime.core.kv_cache_manager import KVCacheManager
from kvserve.runtime.core.outputs import ModelRunnerOutput
from kvserve.runtime.core.scheduler import Scheduler, SchedulerConfig
from kvserve.runtime.planner.reuse import Runs, Seen
from kvserve.runtime.planner.step_time import StepTimeModel, StepWork, step_work
from kvserve.runtime.request import Request
from kvserve.runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class LengthSpec:
    """A fixed length (lo == hi) or uniform on [lo, hi]. Parsed from "N" or "LO:HI"."""

    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str | int, name: str) -> LengthSpec:
        s = str(text)
        try:
            lo, hi = (int(p) for p in s.split(":", 1)) if ":" in s else (int(s), int(s))
        except ValueError:
            raise ValueError(f"{name}: expected N or LO:HI, got {s!r}") from None
        if lo < 1 or hi < lo:
            raise ValueError(f"{name}: need 1 <= LO <= HI, got {s!r}")
        return cls(lo, hi)

    def draw(self, rng: random.Random) -> int:
        return self.lo if self.lo == self.hi else rng.randint(self.lo, self.hi)


@dataclass(frozen=True)
class Workload:
    prompt_len: LengthSpec = LengthSpec(512, 512)
    output_len: LengthSpec = LengthSpec(128, 128)
    num_requests: int = 1000
    request_rate: float | None = None  # req/s, Poisson; None = closed loop
    concurrency: int | None = None
    prefix_len: int = 0  # tokens shared by every prompt
    # (arrival s, prompt len, output len): open loop at those arrivals; with `concurrency`, a closed loop that sends
    # the trace's lengths in order, its streams starting at the first `concurrency` arrivals (a ramp; the later
    # arrivals are unused), to replay a measured closed loop request for request.
    trace: tuple[tuple[float, int, int], ...] = ()
    # With a trace: each request's prompt token ids, in the trace's order (a replay of measured requests whose
    # prompts share prefixes other than one common prefix, e.g. multi-turn chats). The prefix cache then sees
    # exactly the measured prompts' hits; their lengths override the trace's.
    prompts: tuple[tuple[int, ...], ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.trace and (self.request_rate is None) == (self.concurrency is None):
            raise ValueError("workload: give exactly one of request_rate or concurrency (or a trace)")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.prompts and len(self.prompts) != len(self.trace):
            raise ValueError(f"prompts: one per trace entry, got {len(self.prompts)} for {len(self.trace)}")


def load_trace(path: str) -> tuple[tuple[float, int, int], ...]:
    """JSONL, one request a line: {"arrival_s": float, "prompt_len": int, "output_len": int}."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    d = json.loads(line)
                    out.append((float(d["arrival_s"]), int(d["prompt_len"]), int(d["output_len"])))
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{n}: bad trace line ({e})") from None
    return tuple(sorted(out))


ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class EngineShape:
    """What the replica's scheduler is configured with (the same fields the engine passes). The defaults are
    the engine's own (EngineArgs; the scheduler's standalone max_model_len), never restated here."""

    num_blocks: int
    block_size: int = engine_args.default("block_size")
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    max_model_len: int = SchedulerConfig.max_model_len
    enable_prefix_caching: bool = engine_args.default("enable_prefix_caching")
    # Seconds the front-end (HTTP parsing, validation, the hand-off to the engine) spends on each request, one
    # request after another: a burst of N requests reaches the scheduler over N * admission_s, and the engine
    # starts stepping with the first ones. 0 = every request reaches the scheduler when it arrives (in-process).
    admission_s: float = 0.0
    # Prefill/decode disaggregation (disagg.py): "both" is an aggregated replica. "prefill" runs each request's
    # prompt and its first token only (max_tokens 1, as vLLM's P/D proxy sends it). "decode" receives each
    # prompt's KV from a prefill replica: the pulled tokens cost no token budget and no compute (vLLM's external
    # computed tokens), the replica computes only the last prompt token (the row that samples the first token)
    # and the decodes. The scheduler here has no notion of pulled tokens, so it gets its budget raised by the
    # longest prompt (a pulled prompt then never displaces a decode) and the step-time model is charged only
    # what is computed (`pulled_step_work`).
    role: str = "both"
    # Speculative decoding (issue 44 scope 7): up to this many drafts per decoding request each step, as the
    # engine's proposer sets them (spec_decode/proposer.py); the scheduler schedules them (1 + k tokens, which
    # the step-time model charges as the target's verification) and each draft is accepted with probability
    # spec_acceptance_rate while the ones before it were (vllm:spec_decode acceptance per position falls the
    # same way). The draft model's own time is not modelled (n-gram and suffix drafts cost ~nothing).
    num_speculative_tokens: int = 0
    spec_acceptance_rate: float = 0.0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if not 0.0 <= self.spec_acceptance_rate <= 1.0:
            raise ValueError(f"spec_acceptance_rate must be in [0, 1], got {self.spec_acceptance_rate}")


@dataclass
class SimResult:
    num_requests: int
    duration_s: float
    output_tokens_per_s: float
    requests_per_s: float
    ttft_s: dict = field(default_factory=dict)  # p50/p90/p99
    tpot_s: dict = field(default_factory=dict)  # p50/p90/p99
    e2e_s: dict = field(default_factory=dict)  # p50/p90/p99: arrival to last token
    kv_peak_usage: float = 0.0
    num_preemptions: int = 0
    num_steps: int = 0
    # Time-weighted mean of the scheduler's queue (num_waiting, what vllm:num_requests_waiting exports) over
    # the run: the HPA's per-replica metric, so the planner can say at which queue depth the SLO still holds.
    mean_queue_depth: float = 0.0
    step_tokens: list[int] = field(default_factory=list)  # tokens of each step, when simulate(record_steps=True)
    # simulate(..., stop_when_missed=...) stopped as soon as the SLO's verdict was certain to be a miss: the
    # percentiles above are of the requests measured so far, and the run does not meet any SLO at least as tight.
    stopped_on_miss: bool = False
    # Each request's TTFT in the order the workload drew the requests (nan: no first token yet when the run
    # stopped): disagg.py adds a prefill replica's to a decode replica's request by request.
    ttfts_s: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "ttfts_s"}


class MissLimits(NamedTuple):
    """Latency bounds a run is checked against (an SLO's): `simulate(..., stop_when_missed=MissLimits(...))`
    stops once the run's TTFT p90 or TPOT p99 is certain to exceed them, whatever the remaining requests do."""

    ttft_p90_s: float
    tpot_p99_s: float


def misses_needed(num_values: int, q: float) -> int:
    """How many of `num_values` values above a limit make their q-th percentile (as `percentile` computes it)
    certain to exceed the limit: the sorted index floor((n-1) q) is then above it, and the percentile lies at
    or above that value."""
    return num_values - int((num_values - 1) * q / 100.0) if num_values > 0 else 1


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (q in [0, 100]), linear between closest ranks (numpy's default); 0.0 for no values.
    The one definition for predictions and measurements: `kvserve bench serve` reports with this one too."""
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def pulled_step_work(scheduled, prompt_lens: dict[str, int]) -> StepWork:
    """StepWork of a decode replica's step (role "decode"): a request's prompt positions before its last one
    were pulled from a prefill replica, so only the positions from its last prompt token on are computed."""
    num_tokens = context_tokens = num_sampled = pairs = 0
    for s in scheduled:
        n, start = len(s.token_ids), s.start_position
        first = max(start, prompt_lens[s.req_id] - 1)
        computed = start + n - first
        if computed <= 0:
            continue
        num_tokens += computed
        context_tokens += start + n
        num_sampled += 1 if s.sample else 0
        pairs += computed * first + computed * (computed + 1) // 2
    return StepWork(num_tokens, context_tokens, num_sampled, pairs)


def _token_ids(shared: list[int], number: int, length: int) -> list[int]:
    """A prompt of `length` tokens: the shared prefix, then a tail that no other request has. The tail's first
    two tokens spell the request's number (so its first block's hash, and through the chain every later one,
    differs from every other request's), the rest is filler: only block hashes matter to the scheduler, and
    drawing every token at random cost the planner's search a third of its time."""
    tail = [1 + number % 29_999, 1 + (number // 29_999) % 29_999]
    return (shared + tail + [7] * max(0, length - len(shared) - 2))[:length]


def _propose_drafts(running: list[Request], k: int, max_model_len: int) -> None:
    """Drafts on every running request about to decode, as the engine's proposer sets them before a schedule:
    k of them, fewer where the context or the request's max_tokens leaves less room (the ids are dummies)."""
    for request in running:
        request.spec_token_ids = []
        if request.num_tokens - request.num_computed_tokens != 1:
            continue
        room = min(k, max_model_len - request.num_tokens - 1, request.max_tokens - request.num_output_tokens - 1)
        if room > 0:
            request.spec_token_ids = [7] * room


def accepted_drafts(rng: random.Random, num_drafts: int, acceptance_rate: float) -> int:
    """How many of a request's drafts the target accepts: each with probability acceptance_rate, stopping at
    the first rejection (expected sum of rate^i for i in 1..num_drafts)."""
    n = 0
    while n < num_drafts and rng.random() < acceptance_rate:
        n += 1
    return n


def _spec_output(scheduled, rng: random.Random, acceptance_rate: float) -> ModelRunnerOutput:
    """The runner's answer to a step with drafts: a verified request gets its accepted drafts and the token
    after them (spec_token_ids), every other sampling request one token."""
    sampled, spec = {}, {}
    for s in scheduled:
        if not s.sample:
            continue
        if s.num_spec_tokens:
            spec[s.req_id] = [7] * (accepted_drafts(rng, s.num_spec_tokens, acceptance_rate) + 1)
        else:
            sampled[s.req_id] = 1
    return ModelRunnerOutput(sampled_token_ids=sampled, spec_token_ids=spec)


class _FrontEnd:
    """The API server's admission (EngineShape.admission_s): requests in the order the clients sent them, one
    after another, each reaching the scheduler admission_s after the front-end took it (or after it arrived,
    if the front-end was idle). Requests are taken in arrival order as the clock passes their arrival: a
    closed loop's later stream starts (a ramp) are known from the start, and booking the front-end for them
    up front queued every request sent before them behind them (a request sent at 0.1 s waited for a stream
    starting at 0.23 s; TTFT p90 4x the measured on a 16-stream ramp of the accuracy grid)."""

    def __init__(self, admission_s: float):
        self.admission_s = admission_s
        self.free_at = 0.0  # when the front-end has handed over every request taken so far
        self.admitting: list[tuple[float, int, Request]] = []  # (when it reaches the scheduler, tiebreak, request)

    def due(self, pending: list, now: float) -> list[Request]:
        """The requests that reach the scheduler by `now`; takes every arrival up to `now` off `pending`."""
        if self.admission_s <= 0:
            out = []
            while pending and pending[0][0] <= now:
                out.append(heapq.heappop(pending)[2])
            return out
        while pending and pending[0][0] <= now:
            self._take(pending)
        out = []
        while self.admitting and self.admitting[0][0] <= now:
            out.append(heapq.heappop(self.admitting)[2])
        return out

    def next_time(self, pending: list) -> float | None:
        """When the next request reaches the scheduler (None: no request left). Called when the scheduler is
        idle, so no request can be sent before the next arrival in `pending`: taking it now keeps the order."""
        if self.admission_s <= 0:
            return pending[0][0] if pending else None
        if not self.admitting and pending:
            self._take(pending)
        return self.admitting[0][0] if self.admitting else None

    def _take(self, pending: list) -> None:
        arrival, n, r = heapq.heappop(pending)
        self.free_at = max(self.free_at, arrival) + self.admission_s
        heapq.heappush(self.admitting, (self.free_at, n, r))


def _replayed_prompt(workload: Workload, number: int, max_model_len: int) -> list[int]:
    """Request `number`'s (1-based, in trace order) replayed prompt ids (Workload.prompts), cut to what the
    replica admits; [] without replayed prompts."""
    if not workload.prompts:
        return []
    return list(workload.prompts[number - 1][: max_model_len - 1])


def simulate(
    workload: Workload,
    shape: EngineShape,
    step_model: StepTimeModel,
    record_steps: bool = False,
    stop_when_missed: MissLimits | None = None,
    runs: Runs | None = None,
) -> SimResult:
    """One replica's run of the workload. With `stop_when_missed`, the run ends as soon as enough requests have
    exceeded a limit that its percentile is certain to (`SimResult.stopped_on_miss`): a search that only asks
    "is the SLO met?" then pays for an overloaded trial only until the answer is known.

    Shortcuts that leave the result unchanged (tests/test_planner_sim.py compares them with the plain run):
    - Without a shared prefix no prompt shares a block with another (`_token_ids`), so the prefix cache can
      only hit a request's own blocks after a preemption. The run goes without it (hashing every block was a
      third of a run's time) until a request is preempted, and then starts again with it.
    - The KV pool starts small and grows, up to the replica's size, before any step that could ask for more
      blocks than it has free (`_GrowingPool`): the scheduler only asks it "can these blocks be allocated?", and
      it answers exactly as the replica's pool would, so the schedule is the same. Building a pool of 30,000+ block
      objects for every run cost a third of a passing run; most runs hold a few thousand. The peak usage is
      reported against the replica's pool.
    The prefix cache keeps freed blocks for later hits, which a pool that grows late would evict sooner: with a
    shared prefix, or for the rerun after a preemption, the run has the replica's pool from the start.
    - `runs`: a run its limits never touched is reused for another max_num_seqs or pool size (`Runs`)."""
    if runs is not None:
        known = runs.lookup(workload, shape, step_model, record_steps, stop_when_missed)
        if known is not None:
            return known
    shares = workload.prefix_len > 0 or bool(workload.prompts)
    private = not (shape.enable_prefix_caching and shares) and not _fills_the_pool(workload, shape)
    seen = Seen()
    run = functools.partial(_simulate, workload, shape, step_model, record_steps, stop_when_missed)
    result = None
    if private:
        grown = functools.partial(_GrowingPool, initial_blocks=INITIAL_POOL_BLOCKS)
        try:
            result = run(False, grown, shape.enable_prefix_caching, seen=seen)
        except _Preempted:
            seen = Seen()  # the rerun's, with the prefix cache: not reused
    if result is None:
        result = run(shape.enable_prefix_caching, KVCacheManager, seen=seen)
    if runs is not None:
        runs.store(workload, shape, step_model, record_steps, stop_when_missed, result, seen)
    return result


def _fills_the_pool(workload: Workload, shape: EngineShape) -> bool:
    """A closed loop whose streams' shortest sequences already overfill the pool preempts for sure: the run
    without the prefix cache would only be thrown away (the saturation run of slo.replica_capacity)."""
    if workload.concurrency is None or workload.trace:
        return False
    streams = min(workload.concurrency, workload.num_requests, shape.max_num_seqs)
    tokens = min(workload.prompt_len.lo + workload.output_len.lo, shape.max_model_len)
    return streams * -(-tokens // shape.block_size) > shape.num_blocks - 1


class _Preempted(Exception):
    """A run without the prefix cache preempted a request: from here on the cache would change the schedule."""


INITIAL_POOL_BLOCKS = 1024  # the growing pool's first size; it doubles (at most to the replica's pool)


class _GrowingPool(KVCacheManager):
    """The real KV manager over a pool that starts with `initial_blocks` and doubles, up to `num_blocks`, before
    a step that could ask for more blocks than are free (`make_room`): an allocation is then refused only when the
    full pool would refuse it (the schedule never sees the pool's size otherwise). Growing before the step, not
    inside allocate_slots, keeps that hot call the KV manager's own, without a wrapper around each of them."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, initial_blocks: int):
        super().__init__(min(num_blocks, initial_blocks), block_size, enable_caching=enable_caching)
        self.max_blocks = num_blocks

    def make_room(self, blocks: int) -> None:
        """Grow until `blocks` are free, or to the replica's pool."""
        while self.pool.num_free_blocks < blocks and self.pool.num_blocks < self.max_blocks:
            self._grow()

    @property
    def refused(self) -> bool:
        """Whether an allocation may have been refused by the replica's whole pool (Runs): it grew to it."""
        return self.pool.num_blocks >= self.max_blocks

    def _grow(self) -> None:
        pool = self.pool
        size = min(self.max_blocks, 2 * pool.num_blocks)
        for block_id in range(pool.num_blocks, size):
            block = KVCacheBlock(block_id)
            pool.blocks.append(block)
            pool.free_queue.append(block)
        pool.num_blocks = size


def _simulate(
    workload: Workload,
    shape: EngineShape,
    step_model: StepTimeModel,
    record_steps: bool,
    stop_when_missed: MissLimits | None,
    enable_caching: bool,
    kv_manager=KVCacheManager,
    stop_on_preemption: bool = False,
    seen: Seen | None = None,
) -> SimResult:
    rng = random.Random(workload.seed)
    kv = kv_manager(shape.num_blocks, shape.block_size, enable_caching=enable_caching)
    budget = shape.max_num_batched_tokens
    if shape.role == "decode":  # pulled prompts take no budget (EngineShape.role)
        longest = max((p for _, p, _ in workload.trace), default=0) or workload.prompt_len.hi
        budget += min(longest, shape.max_model_len - 1)
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=shape.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=shape.max_model_len,
        ),
        kv,
    )
    prompt_lens: dict[str, int] = {}
    shared = [rng.randrange(1, 30000) for _ in range(workload.prefix_len)]
    seq = 0

    def make(arrival: float, plen: int, olen: int) -> tuple[float, Request]:
        nonlocal seq
        seq += 1
        ids = _replayed_prompt(workload, seq, shape.max_model_len) or _token_ids(
            shared, seq, min(plen, shape.max_model_len - 1)
        )
        plen = len(ids)
        if shape.role == "prefill":
            olen = 1
        prompt_lens[f"r{seq}"] = plen
        req = Request(
            f"r{seq}",
            ids,
            SamplingParams(max_tokens=olen, ignore_eos=True),
            arrival_time=arrival,
        )
        return arrival, req

    pending: list[tuple[float, int, Request]] = []  # (client's arrival, tiebreak, request) heap
    front_end = _FrontEnd(shape.admission_s)

    closed_lengths = iter([(p, o) for _, p, o in workload.trace])

    def next_lengths() -> tuple[int, int]:
        if workload.trace:
            return next(closed_lengths)
        return workload.prompt_len.draw(rng), workload.output_len.draw(rng)

    if workload.trace and workload.concurrency is None:
        for t, p, o in workload.trace:
            a, r = make(t, p, o)
            heapq.heappush(pending, (a, seq, r))
        total = len(workload.trace)
    elif workload.request_rate is not None:
        t = 0.0
        for _ in range(workload.num_requests):
            t += rng.expovariate(workload.request_rate)
            a, r = make(t, workload.prompt_len.draw(rng), workload.output_len.draw(rng))
            heapq.heappush(pending, (a, seq, r))
        total = workload.num_requests
    else:
        total = len(workload.trace) or workload.num_requests
        for k in range(min(workload.concurrency, total)):
            a, r = make(workload.trace[k][0] if workload.trace else 0.0, *next_lengths())
            heapq.heappush(pending, (a, seq, r))

    now = 0.0
    first_token: dict[str, float] = {}
    arrival: dict[str, float] = {}
    num_out: dict[str, int] = {}
    ttft, tpot, e2e = [], [], []
    ttft_of: dict[str, float] = {}
    finished = peak = max_running = max_step_tokens = 0
    steps = 0
    total_out = 0
    queue_area = 0.0  # integral of num_waiting over simulated seconds
    step_tokens: list[int] = []
    # Early stop: requests over each limit so far, and how many make the percentile certain to miss. A request
    # with one output token has no TPOT: `total` bounds the TPOT count from above, and a larger count needs more
    # misses, so the stop stays certain.
    ttft_over = tpot_over = 0
    stopped = False
    ttft_misses_needed = misses_needed(total, 90)
    tpot_misses_needed = misses_needed(total, 99)
    drafting = shape.num_speculative_tokens > 0
    spec_rng = random.Random(f"{workload.seed}-spec")
    # The most blocks one step can allocate: a request computing n tokens takes at most ceil(n / block_size) new
    # blocks, the scheduled tokens stay within the budget and the scheduled requests within max_num_seqs.
    make_room, step_blocks = getattr(kv, "make_room", None), budget // shape.block_size + shape.max_num_seqs + 1
    while finished < total and not stopped:
        if make_room is not None:
            make_room(step_blocks)
        for r in front_end.due(pending, now):
            arrival[r.request_id] = r.arrival_time  # TTFT counts from the client's arrival, admission included
            sched.add_request(r)
        if drafting:
            _propose_drafts(sched.running, shape.num_speculative_tokens, shape.max_model_len)
        out = sched.schedule()
        if stop_on_preemption and out.num_preempted:
            raise _Preempted
        if out.is_empty:
            next_admission = front_end.next_time(pending)
            if next_admission is None:
                raise RuntimeError("simulation stalled: a request cannot be scheduled (KV pool too small?)")
            now = max(now, next_admission)
            continue
        work = pulled_step_work(out.scheduled, prompt_lens) if shape.role == "decode" else step_work(out.scheduled)
        if record_steps:
            step_tokens.append(work.num_tokens)
        step_s = step_model.step_seconds(*work)
        queue_area += sched.num_waiting * step_s
        now += step_s
        steps += 1
        peak = max(peak, kv.pool.num_blocks - 1 - kv.num_free_blocks)  # blocks held (block 0 is the null block)
        max_running = max(max_running, len(sched.running))
        max_step_tokens = max(max_step_tokens, work.num_tokens)
        if drafting:
            runner_out = _spec_output(out.scheduled, spec_rng, shape.spec_acceptance_rate)
        else:
            runner_out = ModelRunnerOutput(sampled_token_ids={s.req_id: 1 for s in out.scheduled if s.sample})
        for o in sched.update_from_output(out, runner_out):
            rid = o.req_id
            total_out += len(o.new_token_ids)
            num_out[rid] = num_out.get(rid, 0) + len(o.new_token_ids)
            if rid not in first_token:
                first_token[rid] = now
                ttft.append(now - arrival[rid])
                ttft_of[rid] = ttft[-1]
                if stop_when_missed is not None and ttft[-1] > stop_when_missed.ttft_p90_s:
                    ttft_over += 1
                    stopped = stopped or ttft_over >= ttft_misses_needed
            if o.finish_reason is not None:
                finished += 1
                e2e.append(now - arrival[rid])
                if num_out[rid] > 1:
                    tpot.append((now - first_token[rid]) / (num_out[rid] - 1))
                    if stop_when_missed is not None and tpot[-1] > stop_when_missed.tpot_p99_s:
                        tpot_over += 1
                        stopped = stopped or tpot_over >= tpot_misses_needed
                if workload.concurrency is not None and seq < total:
                    a, r = make(now, *next_lengths())
                    heapq.heappush(pending, (a, seq, r))
    duration = max(now, 1e-9)
    if seen is not None:
        seen.max_running, seen.peak_blocks, seen.max_step_tokens = max_running, peak, max_step_tokens
        seen.refused = getattr(kv, "refused", True)
    return SimResult(
        num_requests=total,
        duration_s=duration,
        output_tokens_per_s=total_out / duration,
        requests_per_s=total / duration,
        ttft_s={"p50": percentile(ttft, 50), "p90": percentile(ttft, 90), "p99": percentile(ttft, 99)},
        tpot_s={"p50": percentile(tpot, 50), "p90": percentile(tpot, 90), "p99": percentile(tpot, 99)},
        e2e_s={"p50": percentile(e2e, 50), "p90": percentile(e2e, 90), "p99": percentile(e2e, 99)},
        kv_peak_usage=peak / (shape.num_blocks - 1),  # blocks held at the peak, of the replica's real pool
        num_preemptions=sched.num_preemptions,
        num_steps=steps,
        mean_queue_depth=queue_area / duration,
        step_tokens=step_tokens,
        stopped_on_miss=stopped,
        ttfts_s=[ttft_of.get(f"r{k}", math.nan) for k in range(1, seq + 1)],
    )

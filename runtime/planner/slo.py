"""One replica's capacity under a latency SLO, and the HPA bounds that follow from it.

The capacity is Vidur-Search's: the highest Poisson request rate at which the simulated replica still meets
the SLO, found by bisection. With a fixed seed, the arrival gaps at rate r are the same draws scaled by 1/r
(random.expovariate), so the runs at different rates see the same request sequence and only the load moves.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvserve.runtime.planner.reuse import Runs
from kvserve.runtime.planner.simulator import EngineShape, MissLimits, SimResult, Workload, simulate
from kvserve.runtime.planner.step_time import StepTimeModel

ALONE_REQUESTS = 50
BISECTION_STEPS = 7  # the bracket shrinks to 1/128 of the saturation rate: well under the model's own error
# The bisection first tries where it would end if every trial met the SLO (below saturation the SLO usually holds
# at every rate, so all 7 trials pass): one simulation instead of up to 7. Met there, the trials before it are
# taken as met too: the bisection itself presumes the verdict is monotone in the rate (a rate that meets the SLO
# has every lower one meet it). Missed there, it bisects as before. tests/test_planner_fleet.py compares both.
LEAP = True


@dataclass(frozen=True)
class SLO:
    ttft_p90_s: float
    tpot_p99_s: float

    def __post_init__(self) -> None:
        for name, value in (("ttft_p90_s", self.ttft_p90_s), ("tpot_p99_s", self.tpot_p99_s)):
            if not value > 0:
                raise ValueError(f"slo {name} must be > 0 seconds, got {value!r}")

    def met_by(self, result: SimResult) -> bool:
        if result.stopped_on_miss:  # stopped on these limits (at_rate) or tighter ones: a miss either way
            return False
        return result.ttft_s["p90"] <= self.ttft_p90_s and result.tpot_s["p99"] <= self.tpot_p99_s

    @property
    def limits(self) -> MissLimits:
        return MissLimits(self.ttft_p90_s, self.tpot_p99_s)


@dataclass(frozen=True)
class Capacity:
    """`requests_per_s` is 0 when the SLO fails even for requests that never queue (`reason` says which
    metric); `at_capacity` is the simulation at that rate (the light-load one when infeasible)."""

    requests_per_s: float
    at_capacity: SimResult
    reason: str = ""
    fails_alone: bool = False  # the SLO fails even for one request at a time (no load can help)

    @property
    def feasible(self) -> bool:
        return self.requests_per_s > 0


def _why_not(slo: SLO, r: SimResult) -> str:
    misses = []
    if r.ttft_s["p90"] > slo.ttft_p90_s:
        misses.append(f"TTFT p90 {r.ttft_s['p90']:.3f} s > {slo.ttft_p90_s:g} s")
    if r.tpot_s["p99"] > slo.tpot_p99_s:
        misses.append(f"TPOT p99 {r.tpot_s['p99']:.4f} s > {slo.tpot_p99_s:g} s")
    return " and ".join(misses)


def at_rate(
    workload: Workload,
    shape: EngineShape,
    step_model: StepTimeModel,
    requests_per_s: float,
    slo: SLO | None = None,
    runs: Runs | None = None,
) -> SimResult:
    """One replica under the workload's lengths with Poisson arrivals at this rate. With `slo`, the run stops as
    soon as it is certain to miss it (`SimResult.stopped_on_miss`): use that only to ask `slo.met_by`. `runs`:
    simulations to reuse (reuse.Runs)."""
    w = dataclasses.replace(workload, request_rate=requests_per_s, concurrency=None, trace=())
    return simulate(w, shape, step_model, stop_when_missed=slo.limits if slo is not None else None, runs=runs)


def replica_capacity(
    workload: Workload,
    shape: EngineShape,
    step_model: StepTimeModel,
    slo: SLO,
    settle_for: tuple[float, float] | None = None,
    met_at: tuple[float, SimResult] | None = None,
    runs: Runs | None = None,
) -> Capacity:
    """The highest request rate one replica serves within the SLO. `workload` gives lengths, prefix sharing,
    the number of requests and the seed; its arrival process is replaced (Poisson at each trial rate).

    `settle_for=(peak, floor)`: stop the bisection once every rate left in the bracket needs the same replica
    count for the peak and the floor rates (`hpa_bounds`): the fleet's size is then decided, and the capacity
    reported is the bracket's lower end, a rate that was simulated and met the SLO. `met_at=(rate, result)`: a
    full run (not stopped early) at that rate already met the SLO: the bisection starts above it. `runs`:
    simulations to reuse (reuse.Runs)."""
    # One request at a time: every request sees the same (empty) engine, so a few dozen give its percentiles.
    alone = dataclasses.replace(
        workload, request_rate=None, concurrency=1, trace=(), num_requests=min(workload.num_requests, ALONE_REQUESTS)
    )
    one_stream = simulate(alone, shape, step_model, runs=runs)
    if not slo.met_by(one_stream):
        why = f"even one request at a time misses the SLO: {_why_not(slo, one_stream)}"
        return Capacity(0.0, one_stream, why, fails_alone=True)
    # Saturation: every sequence slot busy. No open-loop rate above it is sustainable, so it bounds the search.
    saturated = simulate(
        dataclasses.replace(workload, request_rate=None, concurrency=shape.max_num_seqs, trace=()),
        shape,
        step_model,
        runs=runs,
    )
    lo, hi = 0.0, saturated.requests_per_s
    best = one_stream
    if met_at is not None and 0 < met_at[0] < hi and slo.met_by(met_at[1]):
        lo, best = met_at

    def settled(lo: float, hi: float) -> bool:
        return settle_for is not None and lo > 0 and all(_replicas(r, lo) == _replicas_below(r, hi) for r in settle_for)

    steps, leap, missed = BISECTION_STEPS, LEAP, {}
    while steps > 0 and not settled(lo, hi):
        end, n = _all_met_end(lo, hi, steps, settled)
        if leap and n > 1:
            r = at_rate(workload, shape, step_model, end, slo, runs)
            if slo.met_by(r):
                lo, best, steps = end, r, steps - n
                continue
            leap, missed[end] = False, r  # bisect from here on; the step that reaches `end` has its answer
        mid = (lo + hi) / 2
        r = missed.get(mid) or at_rate(workload, shape, step_model, mid, slo, runs)
        if slo.met_by(r):
            lo, best = mid, r
        else:
            hi, leap = mid, False
        steps -= 1
    if lo == 0.0:
        return Capacity(0.0, best, f"no request rate above {hi:.3g} req/s meets the SLO")
    return Capacity(lo, best)


def _all_met_end(lo: float, hi: float, steps: int, settled) -> tuple[float, int]:
    """Where the bisection from (lo, hi) ends if every trial it makes meets the SLO, and after how many trials."""
    n = 0
    while n < steps and not settled(lo, hi):
        lo, n = (lo + hi) / 2, n + 1
    return lo, n


def _replicas(requests_per_s: float, per_replica: float) -> int:
    """Replicas for a rate at this capacity per replica (hpa_bounds' rounding)."""
    return max(1, math.ceil(requests_per_s / per_replica))


def _replicas_below(requests_per_s: float, per_replica: float) -> int:
    """Replicas for a rate at any capacity just under `per_replica` (a rate that divides exactly needs one more)."""
    return max(1, math.floor(requests_per_s / per_replica) + 1)


@dataclass(frozen=True)
class HPABounds:
    min_replicas: int
    max_replicas: int
    target_queue_depth: int  # average vllm:num_requests_waiting per replica the HPA holds

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def hpa_bounds(capacity: Capacity, peak_requests_per_s: float, min_requests_per_s: float = 0.0) -> HPABounds:
    """max: replicas that serve the peak rate within the SLO; min: those for the floor rate (at least 1). The
    queue-depth target is the mean queue one replica holds at its SLO capacity (rounded up, at least 1): a
    fleet averaging more is loaded past the point where the SLO was shown to hold, so it scales out."""
    if not capacity.feasible:
        raise ValueError(f"no replica count meets the SLO: {capacity.reason}")
    if peak_requests_per_s <= 0:
        raise ValueError(f"request_rate must be > 0, got {peak_requests_per_s!r}")
    if not 0 <= min_requests_per_s <= peak_requests_per_s:
        raise ValueError(f"min_request_rate must be in [0, request_rate], got {min_requests_per_s!r}")
    per_replica = capacity.requests_per_s
    max_replicas = _replicas(peak_requests_per_s, per_replica)
    min_replicas = _replicas(min_requests_per_s, per_replica)
    queue = max(1, math.ceil(capacity.at_capacity.mean_queue_depth))
    return HPABounds(min_replicas, max_replicas, queue)

"""The fleet search: for each candidate deployment (GPU x TP, with its KV plan and step-time model), one
replica's SLO capacity (slo.replica_capacity), the replicas a target rate needs, and their hourly cost; the
cheapest feasible candidate is the choice. Per deployment the engine's max_num_seqs and max_num_batched_tokens
are searched too (`tune`). Pure: the candidates are built by the caller (operator/fleet.py from the catalog, for
`kvserve plan` and the operator alike)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import multiprocessing
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.runtime.planner.bounds import min_replicas, min_request_seconds
from kvserve.runtime.planner.reuse import Runs
from kvserve.runtime.planner.simulator import EngineShape, SimResult, Workload
from kvserve.runtime.planner.slo import SLO, HPABounds, at_rate, hpa_bounds, replica_capacity
from kvserve.runtime.planner.step_time import StepTimeModel


@dataclass(frozen=True)
class Candidate:
    gpu: str  # catalog key
    tensor_parallel_size: int
    usd_per_gpu_hour: float
    shape: EngineShape
    step_model: StepTimeModel
    step_time_source: str  # "calibration <device>" or "roofline ..." (an estimate, said so in the output)
    kv_bytes_per_token: int = 0  # the whole model's (kv_plan.Plan, from runtime/capacity): what P/D moves


@dataclass(frozen=True)
class Option:
    candidate: Candidate
    replica_requests_per_s: float
    replicas: int  # for the peak rate; 0 when infeasible
    usd_per_hour: float  # replicas x TP x price; inf when infeasible
    hpa: HPABounds | None
    ttft_p90_s: float  # at one replica's capacity (or light load when infeasible)
    tpot_p99_s: float
    reason: str = ""  # why infeasible
    fails_alone: bool = False  # infeasible even for one request at a time (slo.Capacity.fails_alone)
    # The engine settings the search evaluated for this deployment: (max_num_seqs, max_num_batched_tokens,
    # replica req/s within the SLO, or None when it could not save a replica), in the order tried, the resolved
    # settings first; () when the settings were fixed.
    tried: tuple[tuple[int, int, float | None], ...] = ()
    pruned: bool = False  # not simulated: its cost floor is above the chosen fleet's cost (search's bound)
    pending: bool = False  # not known yet: the operator's plan is still running (operator/fleet.plan_replica)

    def to_dict(self) -> dict:
        c = self.candidate
        return {
            "gpu": c.gpu,
            "tensor_parallel_size": c.tensor_parallel_size,
            "usd_per_gpu_hour": c.usd_per_gpu_hour,
            "max_num_seqs": c.shape.max_num_seqs,
            "max_num_batched_tokens": c.shape.max_num_batched_tokens,
            "kv_blocks_per_gpu": c.shape.num_blocks,
            "step_time_source": c.step_time_source,
            "feasible": self.hpa is not None,
            "replica_requests_per_s": self.replica_requests_per_s,
            "replicas": self.replicas,
            "gpus": self.replicas * c.tensor_parallel_size,
            "usd_per_hour": None if math.isinf(self.usd_per_hour) else self.usd_per_hour,
            "ttft_p90_s_at_capacity": None if math.isnan(self.ttft_p90_s) else self.ttft_p90_s,
            "tpot_p99_s_at_capacity": None if math.isnan(self.tpot_p99_s) else self.tpot_p99_s,
            "hpa": self.hpa.to_dict() if self.hpa else None,
            "reason": self.reason,
            "pruned": self.pruned,
            "engine_settings_tried": [
                {"max_num_seqs": n, "max_num_batched_tokens": t, "replica_requests_per_s": r} for n, t, r in self.tried
            ],
        }


def evaluate(
    candidate: Candidate,
    workload: Workload,
    slo: SLO,
    peak_requests_per_s: float,
    min_requests_per_s: float = 0.0,
    met_at: tuple[float, SimResult] | None = None,
    runs: Runs | None = None,
) -> Option:
    """The candidate's SLO capacity, searched only as far as it decides the fleet's replica counts for the peak
    and floor rates (slo.replica_capacity's settle_for); `met_at`: a full run at a rate that met the SLO; `runs`:
    simulations to reuse (reuse.Runs)."""
    settle = (peak_requests_per_s, min_requests_per_s)
    cap = replica_capacity(
        workload, candidate.shape, candidate.step_model, slo, settle_for=settle, met_at=met_at, runs=runs
    )
    ttft, tpot = cap.at_capacity.ttft_s["p90"], cap.at_capacity.tpot_s["p99"]
    if not cap.feasible:
        return Option(candidate, 0.0, 0, math.inf, None, ttft, tpot, cap.reason, cap.fails_alone)
    hpa = hpa_bounds(cap, peak_requests_per_s, min_requests_per_s)
    cost = hpa.max_replicas * candidate.tensor_parallel_size * candidate.usd_per_gpu_hour
    return Option(candidate, cap.requests_per_s, hpa.max_replicas, cost, hpa, ttft, tpot)


@dataclass(frozen=True)
class Deployment:
    """One GPU x TP whose engine settings the search may choose. `build(max_num_seqs, max_num_batched_tokens)`
    is the candidate with those settings (its KV plan depends on them: the activation reserve), or None when it
    does not fit. `max_num_seqs`/`max_num_batched_tokens` are the resolved settings (`kvserve serve`'s defaults
    or the user's); a grid is () for a setting the user fixed."""

    build: Callable[[int, int], Candidate | None]
    max_num_seqs: int
    max_num_batched_tokens: int
    max_num_seqs_grid: tuple[int, ...] = ()
    max_num_batched_tokens_grid: tuple[int, ...] = ()


# A tuned setting replaces the resolved ones only if it saves this share of the fleet (at least one replica): the
# step-time model is a few percent off, so a smaller saving may be its noise.
MIN_SAVING = 0.05


def _replicas_to_beat(best: Option) -> int:
    """The replica count a tuned setting must reach to replace `best`."""
    return best.replicas - max(1, math.ceil(MIN_SAVING * best.replicas))


def sequences_that_fit(shape: EngineShape, workload: Workload) -> int:
    """An upper bound on the sequences the KV pool holds at once: each running one holds at least the blocks of
    its prompt's own tokens (the shared prefix once for all). More sequence slots than this never run."""
    own_tokens = max(1, workload.prompt_len.lo - workload.prefix_len)
    pool_tokens = (shape.num_blocks - 1) * shape.block_size - workload.prefix_len  # block 0 is the null block
    return max(1, pool_tokens // (-(-own_tokens // shape.block_size) * shape.block_size))


def tune(
    deployment: Deployment, workload: Workload, slo: SLO, peak_requests_per_s: float, min_requests_per_s: float = 0.0
) -> Option | None:
    """The deployment's best engine settings for the SLO at the rate, by coordinate search: the resolved
    settings, then every max_num_seqs of the grid at the resolved token budget, then every budget of the grid
    at the best max_num_seqs (a budget below max_num_seqs is skipped: a full decode batch must fit a step).
    Sequence slots trade queueing (TTFT) for the decode batch's step time (TPOT); the budget trades a prompt's
    prefill steps (TTFT) for the prefill chunk every decode in its step waits for (TPOT).

    A setting replaces the best so far only if it needs fewer replicas for the peak rate (the cost), by at least
    MIN_SAVING of them; otherwise the resolved settings stay, so a plan does not retune on the model's noise. That
    makes most trials one simulation: at the per-replica rate that would save enough replicas, does it meet the
    SLO? Only a setting that does gets the full capacity search. None when no setting fits the GPU."""
    tried: list[tuple[int, int, float | None]] = []  # None: could not save a replica (not searched further)
    seen: set[tuple[int, int]] = set()
    runs = Runs()  # the settings' runs that their differences cannot change (reuse.Runs)

    def trial(best: Option | None, seqs: int, tokens: int) -> Option | None:
        if (seqs, tokens) in seen or tokens < seqs:
            return best
        seen.add((seqs, tokens))
        c = deployment.build(seqs, tokens)
        if c is None:
            return best
        met_at: tuple[float, SimResult] | None = None
        if best is not None and best.hpa is not None:
            if _replicas_to_beat(best) < 1:
                return best  # one replica already: nothing to save
            floor = min_replicas(
                peak_requests_per_s,
                min_request_seconds(c.step_model, workload, c.shape.max_num_batched_tokens, c.shape.max_model_len),
            )
            if floor > _replicas_to_beat(best):  # its cost floor alone rules it out (bounds.py): no simulation
                tried.append((seqs, tokens, None))
                return best
            rate = peak_requests_per_s / _replicas_to_beat(best)
            check = at_rate(workload, c.shape, c.step_model, rate, slo, runs)  # one simulation, not the search
            if not slo.met_by(check):
                tried.append((seqs, tokens, None))
                return best
            met_at = (rate, check)  # the capacity search starts above this rate
        o = evaluate(c, workload, slo, peak_requests_per_s, min_requests_per_s, met_at, runs)
        tried.append((seqs, tokens, o.replica_requests_per_s))
        if best is None or (best.hpa is None and o.hpa is not None):
            return o
        return o if o.hpa is not None and o.replicas <= _replicas_to_beat(best) else best

    best = trial(None, deployment.max_num_seqs, deployment.max_num_batched_tokens)
    if best is None:
        return None
    # One request at a time missing the SLO: slots change nothing then, and only a larger budget can (fewer prefill
    # chunks for a prompt longer than the budget).
    alone_misses = best.fails_alone
    # Slots beyond what the KV pool can hold run like the pool's limit: try each distinct limit once.
    fit = sequences_that_fit(best.candidate.shape, workload)
    runs_like = {min(deployment.max_num_seqs, fit)}
    for seqs in () if alone_misses else deployment.max_num_seqs_grid:
        if min(seqs, fit) not in runs_like:
            runs_like.add(min(seqs, fit))
            best = trial(best, seqs, deployment.max_num_batched_tokens)
    for tokens in deployment.max_num_batched_tokens_grid:
        if not alone_misses or tokens > best.candidate.shape.max_num_batched_tokens:
            best = trial(best, best.candidate.shape.max_num_seqs, tokens)
    if not (deployment.max_num_seqs_grid or deployment.max_num_batched_tokens_grid):
        return best
    return dataclasses.replace(best, tried=tuple(tried))


def _option(
    candidate: Candidate | Deployment, workload: Workload, slo: SLO, peak: float, floor: float
) -> Option | None:
    if isinstance(candidate, Deployment):
        return tune(candidate, workload, slo, peak, floor)
    return evaluate(candidate, workload, slo, peak, floor)


def _cost_floor(candidate: Candidate | Deployment, workload: Workload, peak_requests_per_s: float) -> float:
    """The least USD/h this deployment's fleet can cost at any engine setting the search may try (bounds.py: a
    replica serves at most 1 / min_request_seconds req/s). 0 when it cannot be bounded (it does not build)."""
    if isinstance(candidate, Deployment):
        built = candidate.build(candidate.max_num_seqs, candidate.max_num_batched_tokens)
        budget = max((candidate.max_num_batched_tokens, *candidate.max_num_batched_tokens_grid))
    else:
        built, budget = candidate, candidate.shape.max_num_batched_tokens
    if built is None:
        return 0.0
    seconds = min_request_seconds(built.step_model, workload, budget, built.shape.max_model_len)
    return min_replicas(peak_requests_per_s, seconds) * built.tensor_parallel_size * built.usd_per_gpu_hour


def _pruned(candidate: Candidate | Deployment, floor_usd: float, best_usd: float) -> Option | None:
    built = candidate
    if isinstance(candidate, Deployment):
        built = candidate.build(candidate.max_num_seqs, candidate.max_num_batched_tokens)
    if built is None:
        return None
    why = f"not simulated: costs at least ${floor_usd:.2f}/h by its step-time bound, the choice ${best_usd:.2f}/h"
    return Option(built, 0.0, 0, math.inf, None, math.nan, math.nan, why, pruned=True)


def _order(options: list[Option]) -> list[Option]:
    return sorted(
        options,
        key=lambda o: (o.usd_per_hour, o.replicas * o.candidate.tensor_parallel_size, -o.replica_requests_per_s),
    )


def search(
    candidates: list[Candidate | Deployment],
    workload: Workload,
    slo: SLO,
    peak_requests_per_s: float,
    min_requests_per_s: float = 0.0,
    workers: int | None = None,
    prune: bool = True,
) -> list[Option]:
    """Every candidate evaluated (a Deployment at its best engine settings, `tune`), cheapest first (ties:
    fewer GPUs, then more headroom per replica); infeasible ones last. The first option is the choice when it
    is feasible.

    Branch and bound: candidates run in the order of their cost floor (`_cost_floor`, no simulation), and one
    whose floor is above the cheapest feasible fleet found so far cannot win: it is reported as `pruned`
    instead of simulated. The choice is the one a full search makes. The candidates are independent
    simulations: `workers` processes (default one per CPU) run them side by side, each new one started only if
    the best found so far has not pruned it. prune=False simulates every candidate."""
    floors = [_cost_floor(c, workload, peak_requests_per_s) if prune else 0.0 for c in candidates]
    order = sorted(range(len(candidates)), key=lambda i: floors[i])
    workers = min(len(candidates), os.cpu_count() or 1) if workers is None else workers
    options: list[Option] = []
    best_usd = math.inf

    def take(option: Option | None) -> None:
        nonlocal best_usd
        if option is not None:
            options.append(option)
            if option.hpa is not None:
                best_usd = min(best_usd, option.usd_per_hour)

    def prune_rest(queue: list[int]) -> None:
        for i in queue:
            option = _pruned(candidates[i], floors[i], best_usd)
            if option is not None:
                options.append(option)
        queue.clear()

    queue = list(order)
    args = (workload, slo, peak_requests_per_s, min_requests_per_s)
    if workers <= 1:
        while queue:
            if floors[queue[0]] > best_usd:
                prune_rest(queue)
                break
            take(_option(candidates[queue.pop(0)], *args))
        return _order(options)
    # fork: the workers start at once with the parent's modules (the simulator is pure Python, no threads).
    context = multiprocessing.get_context("fork") if sys.platform == "linux" else None
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        running: set[concurrent.futures.Future] = set()
        while queue or running:
            while queue and len(running) < workers:
                if floors[queue[0]] > best_usd:
                    prune_rest(queue)
                    break
                running.add(pool.submit(_option, candidates[queue.pop(0)], *args))
            done, running = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                take(future.result())
    return _order(options)

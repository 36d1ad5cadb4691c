"""Aggregated or disaggregated? One deployment (GPU x TP) as two pools: prefill replicas that run prompts only
and decode replicas whose steps carry no prefill chunks, the prompt's KV moved between them over a link.

The same simulator as the aggregated plan (simulator.py with the replica's `role`, step_time.py):
- a prefill replica runs each request with one output token (vLLM's proxy sends it with max_tokens 1): its
  TTFT is the prompt's queueing and prefill;
- the KV then crosses the link: prompt tokens x the model's KV bytes per token (kv_plan.Plan, from
  runtime/capacity) / the link's bytes per second;
- a decode replica pulls it (no token budget, no compute: only the last prompt token's row, which samples the
  first token) and decodes; its TTFT share is the wait for a slot and that first step.

Capacity per pool is slo.replica_capacity's bisection with the pool's share of the SLO: the decode pool holds
TPOT p99 and, for TTFT, what the prefill and the transfer leave over; the prefill pool holds the TTFT that the
transfer and the decode pool's share at its capacity leave. The two pools' replica counts for the peak rate then
give the P:D ratio and the cost, (P + D) x TP x price, compared with the aggregated fleet of the same
deployment. The end-to-end TTFT p90 of the chosen counts is checked by adding, request by request, the prefill
TTFT, the transfer and the decode-side TTFT of one replica of each pool at its share of the peak rate (the two
pools are simulated apart, so a request's two waits are taken as independent); a miss adds a prefill replica.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvserve.runtime.planner.bounds import min_replicas, min_request_seconds
from kvserve.runtime.planner.fleet import Candidate
from kvserve.runtime.planner.simulator import SimResult, Workload, percentile, simulate
from kvserve.runtime.planner.slo import SLO, replica_capacity

# A link's default: one 200 Gb/s RDMA NIC per replica (25 GB/s), the class of llm-d's and Dynamo's P/D
# deployments (InfiniBand / RoCE, NIXL over UCX). `kvserve plan --kv-transfer-gb-s` sets it.
DEFAULT_KV_TRANSFER_GB_S = 25.0
MAX_PREFILL_RETRIES = 4  # end-to-end TTFT misses mended by adding prefill replicas, at most this many


@dataclass(frozen=True)
class DisaggregatedFleet:
    prefill_replicas: int  # 0 when infeasible
    decode_replicas: int
    prefill_requests_per_s: float  # one prefill replica's capacity within its share of the SLO
    decode_requests_per_s: float
    transfer_s: float  # the longest prompt's KV over the link
    usd_per_hour: float  # inf when infeasible
    ttft_p90_s: float  # end to end (prefill + transfer + decode side) at the chosen counts; nan when infeasible
    tpot_p99_s: float
    reason: str = ""

    @property
    def feasible(self) -> bool:
        return self.prefill_replicas > 0

    @property
    def ratio(self) -> str:
        return f"{self.prefill_replicas}:{self.decode_replicas}"

    def to_dict(self) -> dict:
        nan = lambda x: None if math.isnan(x) or math.isinf(x) else x  # noqa: E731
        return {
            "feasible": self.feasible,
            "prefill_replicas": self.prefill_replicas,
            "decode_replicas": self.decode_replicas,
            "prefill_decode_ratio": self.ratio if self.feasible else None,
            "prefill_replica_requests_per_s": self.prefill_requests_per_s,
            "decode_replica_requests_per_s": self.decode_requests_per_s,
            "kv_transfer_s": self.transfer_s,
            "usd_per_hour": nan(self.usd_per_hour),
            "ttft_p90_s": nan(self.ttft_p90_s),
            "tpot_p99_s": nan(self.tpot_p99_s),
            "reason": self.reason,
        }


def transfer_seconds(prompt_tokens: int, kv_bytes_per_token: int, link_gb_s: float) -> float:
    """The prompt's KV over the link (the whole model's bytes: every TP rank's slice crosses it)."""
    if not link_gb_s > 0:
        raise ValueError(f"kv_transfer_gb_s must be > 0, got {link_gb_s!r}")
    return prompt_tokens * kv_bytes_per_token / (link_gb_s * 1e9)


def _infeasible(transfer_s: float, why: str) -> DisaggregatedFleet:
    return DisaggregatedFleet(0, 0, 0.0, 0.0, transfer_s, math.inf, math.nan, math.nan, why)


def _at(workload: Workload, rate: float) -> Workload:
    return dataclasses.replace(workload, request_rate=rate, concurrency=None, trace=())


def _end_to_end_ttft(prefill: SimResult, decode: SimResult, transfer_s: float) -> float:
    """TTFT p90 of prefill + transfer + decode side, request by request (the same seed draws the same lengths)."""
    ttfts = [p + transfer_s + d for p, d in zip(prefill.ttfts_s, decode.ttfts_s, strict=False)]
    return percentile(ttfts, 90)


def evaluate_disaggregated(
    candidate: Candidate,
    workload: Workload,
    slo: SLO,
    peak_requests_per_s: float,
    link_gb_s: float = DEFAULT_KV_TRANSFER_GB_S,
) -> DisaggregatedFleet:
    """The cheapest prefill and decode replica counts of this deployment (both pools on its GPU, TP and engine
    settings) that meet the SLO at the peak rate."""
    shape, step_model = candidate.shape, candidate.step_model
    transfer_s = transfer_seconds(workload.prompt_len.hi, candidate.kv_bytes_per_token, link_gb_s)
    # The prefill role gives every request one output token; the workload keeps its output lengths so that
    # its random draws, and so its prompts, are the decode pool's request for request.
    prefill_work = workload
    prefill_shape = dataclasses.replace(shape, role="prefill")
    decode_shape = dataclasses.replace(shape, role="decode")
    # The least TTFT a prefill can have: one prompt at a time on an idle replica.
    alone_work = dataclasses.replace(prefill_work, concurrency=1, request_rate=None, num_requests=20)
    alone = simulate(alone_work, prefill_shape, step_model)
    decode_ttft_budget = slo.ttft_p90_s - transfer_s - alone.ttft_s["p90"]
    if decode_ttft_budget <= 0:
        return _infeasible(
            transfer_s,
            f"a prompt's prefill ({alone.ttft_s['p90']:.3f} s) and KV transfer ({transfer_s:.3f} s) alone exceed "
            f"TTFT p90 {slo.ttft_p90_s:g} s",
        )
    settle = (peak_requests_per_s, 0.0)
    decode_cap = replica_capacity(workload, decode_shape, step_model, SLO(decode_ttft_budget, slo.tpot_p99_s), settle)
    if not decode_cap.feasible:
        return _infeasible(transfer_s, f"decode pool: {decode_cap.reason}")
    prefill_ttft_budget = slo.ttft_p90_s - transfer_s - decode_cap.at_capacity.ttft_s["p90"]
    # The prefill pool has no TPOT (one output token): its TPOT limit cannot bind.
    prefill_slo = SLO(max(prefill_ttft_budget, 1e-9), math.inf)
    prefill_cap = replica_capacity(prefill_work, prefill_shape, step_model, prefill_slo, settle)
    if not prefill_cap.feasible:
        return _infeasible(transfer_s, f"prefill pool: {prefill_cap.reason}")
    num_prefill = max(1, math.ceil(peak_requests_per_s / prefill_cap.requests_per_s))
    num_decode = max(1, math.ceil(peak_requests_per_s / decode_cap.requests_per_s))
    decode_run = simulate(_at(workload, peak_requests_per_s / num_decode), decode_shape, step_model)
    ttft = math.inf
    for _ in range(MAX_PREFILL_RETRIES + 1):
        prefill_run = simulate(_at(prefill_work, peak_requests_per_s / num_prefill), prefill_shape, step_model)
        ttft = _end_to_end_ttft(prefill_run, decode_run, transfer_s)
        if ttft <= slo.ttft_p90_s:
            break
        num_prefill += 1
    else:
        return _infeasible(transfer_s, f"end-to-end TTFT p90 {ttft:.3f} s > {slo.ttft_p90_s:g} s")
    cost = (num_prefill + num_decode) * candidate.tensor_parallel_size * candidate.usd_per_gpu_hour
    return DisaggregatedFleet(
        num_prefill,
        num_decode,
        prefill_cap.requests_per_s,
        decode_cap.requests_per_s,
        transfer_s,
        cost,
        ttft,
        decode_run.tpot_s["p99"],
    )


MODES = ("off", "auto", "on")


@dataclass(frozen=True)
class DisaggregatedOption:
    candidate: Candidate
    fleet: DisaggregatedFleet | None  # None: not simulated, its cost floor is above the choice (`pruned`)
    floor_usd_per_hour: float

    @property
    def usd_per_hour(self) -> float:
        return self.fleet.usd_per_hour if self.fleet is not None else math.inf

    def to_dict(self) -> dict:
        c = self.candidate
        head = {
            "gpu": c.gpu,
            "tensor_parallel_size": c.tensor_parallel_size,
            "max_num_seqs": c.shape.max_num_seqs,
            "max_num_batched_tokens": c.shape.max_num_batched_tokens,
            "usd_per_gpu_hour": c.usd_per_gpu_hour,
        }
        if self.fleet is None:
            why = f"not simulated: costs at least ${self.floor_usd_per_hour:.2f}/h by its step-time bound"
            return {**head, "feasible": False, "pruned": True, "reason": why}
        gpus = (self.fleet.prefill_replicas + self.fleet.decode_replicas) * c.tensor_parallel_size
        return {**head, **self.fleet.to_dict(), "gpus": gpus, "pruned": False}


def search_disaggregated(
    candidates: list[Candidate],
    workload: Workload,
    slo: SLO,
    peak_requests_per_s: float,
    link_gb_s: float = DEFAULT_KV_TRANSFER_GB_S,
    best_usd_per_hour: float = math.inf,
) -> list[DisaggregatedOption]:
    """Each candidate as prefill + decode pools, cheapest first. Branch and bound as the aggregated search
    (fleet.search): both pools together do at least a request's least engine time per request (bounds.py: the
    prefill pool computes its prompt, the decode pool its decodes and one more row), so a candidate whose
    aggregated cost floor is above the cheapest fleet found so far (`best_usd_per_hour`: the aggregated choice
    when both are compared) is not simulated."""
    floors = [
        min_replicas(
            peak_requests_per_s,
            min_request_seconds(c.step_model, workload, c.shape.max_num_batched_tokens, c.shape.max_model_len),
        )
        * c.tensor_parallel_size
        * c.usd_per_gpu_hour
        for c in candidates
    ]
    out = []
    best = best_usd_per_hour
    for i in sorted(range(len(candidates)), key=lambda i: floors[i]):
        if floors[i] > best:
            out.append(DisaggregatedOption(candidates[i], None, floors[i]))
            continue
        fleet = evaluate_disaggregated(candidates[i], workload, slo, peak_requests_per_s, link_gb_s)
        out.append(DisaggregatedOption(candidates[i], fleet, floors[i]))
        best = min(best, fleet.usd_per_hour)
    return sorted(out, key=lambda o: (o.usd_per_hour, o.floor_usd_per_hour))


def decide(mode: str, aggregated_usd_per_hour: float, disaggregated_usd_per_hour: float) -> str | None:
    """Which serving mode the plan chooses: the cheaper feasible one (`auto`; aggregated on a tie: one pool is
    simpler to run), or the one the mode names. None: no feasible fleet in the modes allowed."""
    if mode not in MODES:
        raise ValueError(f"disaggregation must be one of {', '.join(MODES)}, got {mode!r}")
    agg = None if mode == "on" or math.isinf(aggregated_usd_per_hour) else aggregated_usd_per_hour
    dis = None if mode == "off" or math.isinf(disaggregated_usd_per_hour) else disaggregated_usd_per_hour
    if agg is None and dis is None:
        return None
    if dis is None or (agg is not None and agg <= dis):
        return "aggregated"
    return "disaggregated"

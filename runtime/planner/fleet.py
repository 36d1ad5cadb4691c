"""The fleet search: for each candidate deployment (GPU x TP, with its KV plan and step-time model), one
replica's SLO capacity (slo.replica_capacity), the replicas a target rate needs, and their hourly cost; the
cheapest feasible candidate is the choice. Pure: the candidates are built by the caller (operator/fleet.py
from the catalog, for `kvserve plan` and the operator alike)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.runtime.planner.simulator import EngineShape, Workload
from kvserve.runtime.planner.slo import SLO, HPABounds, hpa_bounds, replica_capacity
from kvserve.runtime.planner.step_time import StepTimeModel


@dataclass(frozen=True)
class Candidate:
    gpu: str  # catalog key
    tensor_parallel_size: int
    usd_per_gpu_hour: float
    shape: EngineShape
    step_model: StepTimeModel
    step_time_source: str  # "calibration <device>" or "roofline ..." (an estimate, said so in the output)


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
            "ttft_p90_s_at_capacity": self.ttft_p90_s,
            "tpot_p99_s_at_capacity": self.tpot_p99_s,
            "hpa": self.hpa.to_dict() if self.hpa else None,
            "reason": self.reason,
        }


def evaluate(
    candidate: Candidate, workload: Workload, slo: SLO, peak_requests_per_s: float, min_requests_per_s: float = 0.0
) -> Option:
    cap = replica_capacity(workload, candidate.shape, candidate.step_model, slo)
    ttft, tpot = cap.at_capacity.ttft_s["p90"], cap.at_capacity.tpot_s["p99"]
    if not cap.feasible:
        return Option(candidate, 0.0, 0, math.inf, None, ttft, tpot, cap.reason)
    hpa = hpa_bounds(cap, peak_requests_per_s, min_requests_per_s)
    cost = hpa.max_replicas * candidate.tensor_parallel_size * candidate.usd_per_gpu_hour
    return Option(candidate, cap.requests_per_s, hpa.max_replicas, cost, hpa, ttft, tpot)


def search(
    candidates: list[Candidate],
    workload: Workload,
    slo: SLO,
    peak_requests_per_s: float,
    min_requests_per_s: float = 0.0,
) -> list[Option]:
    """Every candidate evaluated, cheapest first (ties: fewer GPUs, then more headroom per replica);
    infeasible ones last. The first option is the choice when it is feasible."""
    options = [evaluate(c, workload, slo, peak_requests_per_s, min_requests_per_s) for c in candidates]
    return sorted(
        options,
        key=lambda o: (o.usd_per_hour, o.replicas * o.candidate.tensor_parallel_size, -o.replica_requests_per_s),
    )

"""Simulations already run in one search, reused where a setting they differ in cannot matter (simulator.simulate's
`runs`; fleet.tune keeps one per deployment). Shapes and results are the simulator's EngineShape and SimResult,
typed `Any` here: simulator.py imports this module, not the other way round."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class Seen:
    """What a run's limits could have decided (`Runs`): the most requests running after a step's scheduling,
    the most blocks held, the largest step, and whether an allocation was refused by the replica's whole pool."""

    max_running: int = 0
    peak_blocks: int = 0
    max_step_tokens: int = 0  # the most tokens one step scheduled
    refused: bool = True  # unknown (the plain KV manager does not say): never reused


class Runs:
    """Simulations already run in one search, reused where a setting they differ in cannot matter.

    The scheduler reads max_num_seqs only to refuse an admission (len(running) >= max_num_seqs), and the KV
    pool's size only to refuse an allocation (more blocks asked than free). A run that never had more than M
    requests running, never had an allocation refused, and never held more than P blocks is therefore the same
    run, step for step, under any max_num_seqs above M and any pool of more than P usable blocks: every such
    comparison goes the same way. Likewise the token budget (an aggregated replica's): a run whose every step
    scheduled fewer tokens than its budget never had a request cut short or left waiting by it, so it is the same
    under any budget above its largest step. Only runs without the prefix cache qualify (`simulate`'s private
    runs): with it, the pool's size decides which freed blocks survive for later hits. A closed loop's streams
    count as min(concurrency, requests). The tuning search (fleet.tune) tries settings that such runs do not
    reach: their one-request-at-a-time runs (one prompt per step under any larger budget), their saturation runs
    beyond the requests' number, and the bisection trials that follow, are the same runs.
    tests/test_planner_sim.py checks each reuse against a fresh run."""

    def __init__(self) -> None:
        self._runs: dict[tuple, list[tuple[Any, Seen, Any]]] = {}
        self.simulated = 0  # runs simulated through this cache
        self.reused = 0  # runs answered from it
        self.steps = 0  # steps simulated

    @staticmethod
    def _key(workload, shape, step_model, record_steps, stop_when_missed) -> tuple:
        if workload.concurrency is not None:
            total = len(workload.trace) or workload.num_requests
            workload = dataclasses.replace(workload, concurrency=min(workload.concurrency, total))
        budget = shape.max_num_batched_tokens if shape.role != "both" else 0  # other roles change the budget
        shape = dataclasses.replace(shape, num_blocks=0, max_num_seqs=0, max_num_batched_tokens=budget)
        return workload, shape, step_model, record_steps, stop_when_missed

    def lookup(self, workload, shape, step_model, record_steps, stop_when_missed) -> Any:
        for ran, seen, result in self._runs.get(
            self._key(workload, shape, step_model, record_steps, stop_when_missed), ()
        ):
            budget = min(ran.max_num_batched_tokens, shape.max_num_batched_tokens)
            if (
                seen.max_running < min(ran.max_num_seqs, shape.max_num_seqs)
                and seen.peak_blocks <= shape.num_blocks - 1
                and (seen.max_step_tokens < budget or ran.max_num_batched_tokens == shape.max_num_batched_tokens)
            ):
                self.reused += 1
                return dataclasses.replace(
                    result,
                    kv_peak_usage=seen.peak_blocks / (shape.num_blocks - 1),
                    ttft_s=dict(result.ttft_s),
                    tpot_s=dict(result.tpot_s),
                    step_tokens=list(result.step_tokens),
                    ttfts_s=list(result.ttfts_s),
                )
        return None

    def store(self, workload, shape, step_model, record_steps, stop_when_missed, result: Any, seen: Seen):
        self.simulated += 1
        self.steps += result.num_steps
        if not seen.refused and result.num_preemptions == 0:
            key = self._key(workload, shape, step_model, record_steps, stop_when_missed)
            self._runs.setdefault(key, []).append((shape, seen, result))

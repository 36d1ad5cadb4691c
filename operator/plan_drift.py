"""Pure: does a pod serve as its plan predicted? (issue 44 scope 4, the `PlanDrift` condition)

The operator plans spec.slo's fleet from a step-time model (operator/fleet.py, runtime/planner). Each resync it
scrapes every ready engine pod's /metrics (operator/drift.py does that I/O); this module turns two successive
scrapes of one pod into what the pod measured over that window -- its finished requests per second, their mean
prompt and output lengths, mean TTFT and mean TPOT (vLLM's histograms' sum / count, exact) -- and asks the
planner what the plan predicts for that same load: the planner's own simulator (slo.at_rate) with the planned
replica's engine shape and step-time model (fleet.Option.candidate), Poisson arrivals at the measured rate and the
measured lengths. One source of truth: nothing here re-derives a step time.

What is compared: measured mean vs predicted median (the simulator reports percentiles, not means), for TPOT and
TTFT. TPOT is the step time a decode waits for, so it is the sharp signal of a slowed (or faster) pod; TTFT adds
the queueing the planner models least well (issue 44: about 2x under load), hence its wider default tolerance.

Flipping the condition takes `resyncs` consecutive judged windows that disagree with it, both ways, so one noisy
window neither raises nor clears it. A window is judged once it holds `min_requests` finished requests (it keeps
growing across resyncs until then: a quiet pod is judged over a longer window, not on two requests).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvserve.runtime.planner.fleet import Candidate
from kvserve.runtime.planner.simulator import LengthSpec, Workload
from kvserve.runtime.planner.slo import at_rate


@dataclass(frozen=True)
class DriftSettings:
    """The one home of PlanDrift's settings (operator/drift.py reads their KVSERVE_DRIFT_* overrides)."""

    tpot_tolerance: float = 0.25  # |measured / planned - 1| above this is drift (issue 44 measured 12.6% TPOT MAPE)
    ttft_tolerance: float = 0.5  # TTFT's queueing is the planner's weakest prediction (36% MAPE in issue 44)
    resyncs: int = 3  # consecutive judged windows that disagree with the condition before it flips
    min_requests: int = 20  # finished requests a window needs before it is judged
    scrape_timeout_s: float = 2.0  # per pod /metrics request

    def __post_init__(self) -> None:
        for name in ("tpot_tolerance", "ttft_tolerance", "scrape_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"PlanDrift setting {name} must be a number > 0, got {value!r}")
        for name in ("resyncs", "min_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PlanDrift setting {name} must be an integer >= 1, got {value!r}")


# vLLM's histograms (runtime/metrics.py): sum and count of each, as cumulative counters.
HISTOGRAMS = {
    "e2e": "vllm:e2e_request_latency_seconds",  # count: finished requests
    "ttft": "vllm:time_to_first_token_seconds",
    "tpot": "vllm:request_time_per_output_token_seconds",
    "prompt": "vllm:request_prompt_tokens",
    "output": "vllm:request_generation_tokens",
}


@dataclass(frozen=True)
class Counters:
    """One scrape of one pod: (sum, count) of each of HISTOGRAMS, summed over label sets, at `time_s`."""

    time_s: float
    sums: dict[str, float]
    counts: dict[str, float]


def parse_counters(text: str, time_s: float) -> Counters:
    """A pod's /metrics (Prometheus text) -> Counters; a histogram the pod does not export counts as zero.
    Raises ValueError on text that is not the exposition format."""
    wanted = {f"{metric}_{part}": (key, part) for key, metric in HISTOGRAMS.items() for part in ("sum", "count")}
    sums = dict.fromkeys(HISTOGRAMS, 0.0)
    counts = dict.fromkeys(HISTOGRAMS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            hit = wanted.get(sample.name)
            if hit is not None:
                (sums if hit[1] == "sum" else counts)[hit[0]] += float(sample.value)
    return Counters(time_s, sums, counts)


@dataclass(frozen=True)
class Measured:
    """What a pod served over one window."""

    seconds: float
    requests: int  # finished
    requests_per_s: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    ttft_mean_s: float | None  # None: no request got its first token in the window
    tpot_mean_s: float | None  # None: no request with more than one output token finished


def window(start: Counters, end: Counters) -> Measured | None:
    """What the pod served between two scrapes; None when a counter went back (the engine restarted: the
    window starts again at `end`) or no time passed."""
    seconds = end.time_s - start.time_s
    d_sum = {k: end.sums[k] - start.sums[k] for k in HISTOGRAMS}
    d_count = {k: end.counts[k] - start.counts[k] for k in HISTOGRAMS}
    if seconds <= 0 or any(v < 0 for v in d_count.values()) or any(v < 0 for v in d_sum.values()):
        return None

    def mean(key: str) -> float | None:
        return d_sum[key] / d_count[key] if d_count[key] > 0 else None

    requests = int(round(d_count["e2e"]))
    return Measured(
        seconds=seconds,
        requests=requests,
        requests_per_s=requests / seconds,
        mean_prompt_tokens=mean("prompt") or 0.0,
        mean_output_tokens=mean("output") or 0.0,
        ttft_mean_s=mean("ttft"),
        tpot_mean_s=mean("tpot"),
    )


def _two_digits(x: float) -> float:
    """x rounded to two significant digits: successive windows of a steady load share one simulation."""
    if x <= 0:
        return x
    return round(x, 1 - int(math.floor(math.log10(x))))


@dataclass(frozen=True)
class Predicted:
    requests_per_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_p50_s: float
    tpot_p50_s: float


def predict(candidate: Candidate, planned: Workload, measured: Measured) -> Predicted:
    """What the plan predicts for the measured load: the planner's simulator (slo.at_rate) with the planned
    replica (`candidate`: engine shape and step-time model) and the planned workload's request count, prefix and
    seed, at the measured rate and mean lengths (each rounded to two significant digits, and memoised)."""
    rate = _two_digits(measured.requests_per_s)
    prompt = max(1, int(_two_digits(measured.mean_prompt_tokens or planned.prompt_len.lo)))
    output = max(1, int(_two_digits(measured.mean_output_tokens or planned.output_len.lo)))
    return _predict(candidate, planned, rate, prompt, output)


@functools.lru_cache(maxsize=256)
def _predict(candidate: Candidate, planned: Workload, rate: float, prompt: int, output: int) -> Predicted:
    workload = dataclasses.replace(
        planned,
        prompt_len=LengthSpec(prompt, prompt),
        output_len=LengthSpec(output, output),
        request_rate=rate,
        concurrency=None,
        trace=(),
    )
    sim = at_rate(workload, candidate.shape, candidate.step_model, rate)
    return Predicted(rate, prompt, output, sim.ttft_s["p50"], sim.tpot_s["p50"])


@dataclass(frozen=True)
class Deviation:
    metric: str  # "TPOT" or "TTFT"
    measured_s: float
    planned_s: float
    tolerance: float

    @property
    def relative(self) -> float:
        """measured / planned - 1 (+1.0: twice as slow as planned)."""
        return self.measured_s / self.planned_s - 1.0 if self.planned_s > 0 else math.inf

    @property
    def beyond(self) -> bool:
        return abs(self.relative) > self.tolerance

    def text(self) -> str:
        return (
            f"{self.metric} mean {self.measured_s * 1e3:.1f} ms measured vs {self.planned_s * 1e3:.1f} ms planned "
            f"({self.relative:+.0%}, tolerance {self.tolerance:.0%})"
        )


@dataclass(frozen=True)
class Judgement:
    """One judged window of one pod."""

    measured: Measured
    predicted: Predicted
    deviations: tuple[Deviation, ...]

    @property
    def beyond(self) -> bool:
        return any(d.beyond for d in self.deviations)

    @property
    def slower(self) -> bool:
        """The worst deviation beyond tolerance is a slowdown (else a speed-up)."""
        worst = max((d for d in self.deviations if d.beyond), key=lambda d: abs(d.relative), default=None)
        return worst is not None and worst.relative > 0

    def text(self) -> str:
        m = self.measured
        load = (
            f"at {m.requests_per_s:.3g} req/s, {m.mean_prompt_tokens:.0f} prompt / {m.mean_output_tokens:.0f} "
            f"output tokens ({m.requests} requests over {m.seconds:.3g} s)"
        )
        return "; ".join(d.text() for d in self.deviations) + " " + load


def judge(measured: Measured, predicted: Predicted, settings: DriftSettings) -> Judgement | None:
    """Compare a window with the plan's prediction for its load; None while the window is too small to judge."""
    if measured.requests < settings.min_requests:
        return None
    deviations = []
    if measured.tpot_mean_s is not None and predicted.tpot_p50_s > 0:
        deviations.append(Deviation("TPOT", measured.tpot_mean_s, predicted.tpot_p50_s, settings.tpot_tolerance))
    if measured.ttft_mean_s is not None and predicted.ttft_p50_s > 0:
        deviations.append(Deviation("TTFT", measured.ttft_mean_s, predicted.ttft_p50_s, settings.ttft_tolerance))
    if not deviations:
        return None
    return Judgement(measured, predicted, tuple(deviations))


@dataclass(frozen=True)
class PodDrift:
    """One pod's standing: `drifted` flips after `settings.resyncs` consecutive judgements that disagree."""

    drifted: bool = False
    disagreeing: int = 0  # consecutive judged windows that disagree with `drifted`
    last: Judgement | None = None
    last_beyond: Judgement | None = None  # the newest judgement beyond tolerance: what a drifted message names


def advance(state: PodDrift, judgement: Judgement, settings: DriftSettings) -> PodDrift:
    beyond = judgement if judgement.beyond else state.last_beyond
    if judgement.beyond == state.drifted:
        return PodDrift(state.drifted, 0, judgement, beyond)
    disagreeing = state.disagreeing + 1
    if disagreeing >= settings.resyncs:
        return PodDrift(not state.drifted, 0, judgement, beyond)
    return PodDrift(state.drifted, disagreeing, judgement, beyond)


MAX_PODS_NAMED = 3


def condition(pods: dict[str, PodDrift], settings: DriftSettings, waiting: str = "") -> tuple[bool, str, str]:
    """PlanDrift (status, reason, message) from every ready pod's standing. `waiting`: why no pod was judged
    yet (no ready pod, a scrape failed ...), for the NotMeasured message."""
    drifted = sorted(
        ((name, p) for name, p in pods.items() if p.drifted and p.last_beyond is not None), key=lambda item: item[0]
    )
    if drifted:
        slower = any(p.last_beyond.slower for _, p in drifted)
        named = [f"pod {name}: {p.last_beyond.text()}" for name, p in drifted[:MAX_PODS_NAMED]]
        more = f"; and {len(drifted) - MAX_PODS_NAMED} more pods" if len(drifted) > MAX_PODS_NAMED else ""
        return (
            True,
            "SlowerThanPlanned" if slower else "FasterThanPlanned",
            f"{len(drifted)}/{len(pods)} ready pods beyond tolerance for {settings.resyncs} resyncs: "
            + "; ".join(named)
            + more,
        )
    judged = sorted(((name, p) for name, p in pods.items() if p.last is not None), key=lambda item: item[0])
    if judged:
        name, p = max(judged, key=lambda item: max(abs(d.relative) for d in item[1].last.deviations))
        return (
            False,
            "WithinTolerance",
            f"{len(judged)}/{len(pods)} ready pods measured within tolerance; the farthest, pod {name}: "
            f"{p.last.text()}",
        )
    return (
        False,
        "NotMeasured",
        waiting or f"no ready pod has served {settings.min_requests} requests since the operator started watching",
    )

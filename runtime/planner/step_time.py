"""Step-time model: seconds for one engine step from what the step does.

One step's time is modelled as a sum of its phases:
  the GEMMs over the step's tokens: a curve g(num_tokens)      -> token_curve, or overhead_s + per_token_s * T
  the LM head and sampling of each row that samples            -> per_sampled_s * num_sampled
  attention's KV reads (decode: memory-bound)                  -> per_context_token_s * context_tokens
  attention's query-key work (prefill: compute-bound)          -> per_attention_pair_s * attention_pairs
Why a curve and not a line for the GEMMs: a step of a few tokens reads every weight once and is memory-bound
(on a 125M fp32 model on one CPU core, decode batches 1 to 8 all take ~40 ms); past the crossover the step is
compute-bound and grows with the tokens. A line through both regimes over-predicts one and under-predicts the
other. Why the LM head apart: only the rows that sample run it (one per decode, one per finished prefill), so
a decode token costs more than a prefill token. Why two attention terms: a decode token reads its whole
context once (bytes), a prefill chunk of n tokens after s cached ones does n*(s+n/2) query-key products
(FLOPs); one "context tokens" variable charged a 1000-token prompt like one decode at context 1000.

The coefficients come from a least-squares fit over profiled steps (`fit`), or from published peak FLOPs and
bandwidth with efficiency factors (`from_hardware`). Pure Python: no numpy, so the operator can use it.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import NamedTuple


class StepWork(NamedTuple):
    """What one step computes, counted the same way when calibrating on the engine and when simulating."""

    num_tokens: int  # tokens whose KV the step computes (prefill chunk tokens + one per decode)
    context_tokens: int  # sum over scheduled requests of the KV tokens attended (start position + new tokens)
    num_sampled: int = 0  # rows that run the LM head and sample (decodes, last chunk of a prefill)
    attention_pairs: int = 0  # query-key products: n*s + n*(n+1)/2 per request (s cached, n new tokens)


@dataclass(frozen=True)
class StepSample:
    num_tokens: int
    context_tokens: int
    seconds: float
    num_sampled: int = 0
    attention_pairs: int = 0

    @classmethod
    def of(cls, work: StepWork, seconds: float) -> StepSample:
        return cls(work.num_tokens, work.context_tokens, seconds, work.num_sampled, work.attention_pairs)

    @property
    def work(self) -> StepWork:
        return StepWork(self.num_tokens, self.context_tokens, self.num_sampled, self.attention_pairs)


def step_work(scheduled) -> StepWork:
    """StepWork of one step's scheduled requests (SchedulerOutput.scheduled)."""
    num_tokens = context_tokens = num_sampled = pairs = 0
    for s in scheduled:
        n = len(s.token_ids)
        num_tokens += n
        context_tokens += s.start_position + n
        num_sampled += 1 if s.sample else 0
        pairs += n * s.start_position + n * (n + 1) // 2
    return StepWork(num_tokens, context_tokens, num_sampled, pairs)


@dataclass(frozen=True)
class StepTimeModel:
    overhead_s: float
    per_token_s: float
    per_context_token_s: float
    per_sampled_s: float = 0.0
    per_attention_pair_s: float = 0.0
    # ((num_tokens, seconds), ...) ascending: when given, g(T) is linear between these points and continues the
    # end segments' slopes outside them, replacing overhead_s + per_token_s * T.
    token_curve: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if len(self.token_curve) == 1:
            raise ValueError("token_curve needs at least 2 points")
        if any(b[0] <= a[0] for a, b in zip(self.token_curve, self.token_curve[1:])):
            raise ValueError("token_curve: token counts must be strictly ascending")

    def token_seconds(self, num_tokens: int) -> float:
        curve = self.token_curve
        if not curve:
            return self.overhead_s + self.per_token_s * num_tokens
        i = min(max(bisect_right([t for t, _ in curve], num_tokens), 1), len(curve) - 1)
        (t0, s0), (t1, s1) = curve[i - 1], curve[i]
        return max(0.0, s0 + (s1 - s0) * (num_tokens - t0) / (t1 - t0))

    def step_seconds(
        self, num_tokens: int, context_tokens: int, num_sampled: int = 0, attention_pairs: int = 0
    ) -> float:
        return (
            self.token_seconds(num_tokens)
            + self.per_sampled_s * num_sampled
            + self.per_context_token_s * context_tokens
            + self.per_attention_pair_s * attention_pairs
        )

    def to_dict(self) -> dict:
        d = {
            "overhead_s": self.overhead_s,
            "per_token_s": self.per_token_s,
            "per_context_token_s": self.per_context_token_s,
            "per_sampled_s": self.per_sampled_s,
            "per_attention_pair_s": self.per_attention_pair_s,
        }
        if self.token_curve:
            d["token_curve"] = [[t, s] for t, s in self.token_curve]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> StepTimeModel:
        """Version-1 calibrations (three coefficients) load as the linear model they were fitted as."""
        return cls(
            float(d["overhead_s"]),
            float(d["per_token_s"]),
            float(d["per_context_token_s"]),
            float(d.get("per_sampled_s", 0.0)),
            float(d.get("per_attention_pair_s", 0.0)),
            tuple((int(t), float(s)) for t, s in d.get("token_curve", ())),
        )

    @classmethod
    def from_hardware(
        cls,
        num_params: float,
        kv_bytes_per_token: float,
        peak_flops: float,
        mem_bandwidth_bytes_s: float,
        weight_bytes: float,
        flops_efficiency: float = 0.5,
        bandwidth_efficiency: float = 0.7,
        host_overhead_s: float = 0.004,
    ) -> StepTimeModel:
        """Roofline-style estimate for a GPU with no calibration: each step reads the weights once (in the
        overhead term: it does not depend on the batch), spends 2*params FLOPs per token and reads each
        context token's KV once. Efficiency factors are stated assumptions, not measurements."""
        bw = mem_bandwidth_bytes_s * bandwidth_efficiency
        return cls(
            overhead_s=host_overhead_s + weight_bytes / bw,
            per_token_s=2.0 * num_params / (peak_flops * flops_efficiency),
            per_context_token_s=kv_bytes_per_token / bw,
        )


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting on a small dense system; a singular column -> 0."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        if abs(m[col][col]) < 1e-300:
            continue
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] if abs(m[i][i]) >= 1e-300 else 0.0 for i in range(n)]


def _lstsq(rows: list[list[float]], targets: list[float], weights: list[float]) -> list[float]:
    """Weighted least squares through the normal equations (a dozen columns at most)."""
    k = len(rows[0])
    ata = [[sum(w * r[i] * r[j] for r, w in zip(rows, weights, strict=True)) for j in range(k)] for i in range(k)]
    atb = [sum(w * r[i] * y for r, y, w in zip(rows, targets, weights, strict=True)) for i in range(k)]
    return _solve(ata, atb)


def _least_squares(samples: list[StepSample]) -> StepTimeModel:
    """The linear model [1, num_tokens, context_tokens] -> seconds, absolute error, coefficients >= 0."""
    rows = [[1.0, float(s.num_tokens), float(s.context_tokens)] for s in samples]
    coef = _lstsq(rows, [s.seconds for s in samples], [1.0] * len(samples))
    return StepTimeModel(*(max(0.0, c) for c in coef))


CURVE_KNOT_RATIO = 1.5  # successive curve knots at least this far apart in tokens (geometric spacing)


def curve_knots(token_counts) -> list[int]:
    """Knots of the token curve: the profiled token counts, thinned to geometric spacing (each knot is a
    measured count, so every segment has samples at both ends), always keeping the smallest and the largest."""
    values = sorted(set(token_counts))
    if not values:
        return []
    knots = [values[0]]
    for v in values[1:]:
        if v >= knots[-1] * CURVE_KNOT_RATIO:
            knots.append(v)
    if knots[-1] != values[-1]:  # the largest is within the ratio of the last knot: it takes its place
        if len(knots) > 1:
            knots[-1] = values[-1]
        else:
            knots.append(values[-1])
    return knots


def _tents(num_tokens: int, knots: list[int]) -> list[float]:
    """Coordinates of T in the hat-function basis of `knots`: sum(c_i * tent_i(T)) is the curve through
    (knot_i, c_i), linear outside the knots along the end segments."""
    i = min(max(bisect_right(knots, num_tokens), 1), len(knots) - 1)
    t0, t1 = knots[i - 1], knots[i]
    u = (num_tokens - t0) / (t1 - t0)
    row = [0.0] * len(knots)
    row[i - 1], row[i] = 1.0 - u, u
    return row


EXTRA_TERMS = ("per_sampled_s", "per_context_token_s", "per_attention_pair_s")


def _fit_curve(samples: list[StepSample], knots: list[int]) -> StepTimeModel:
    """Least squares on relative error (steps span 30 ms decodes to multi-second prefills; absolute error
    would let the prefills decide everything) over [tents(T), num_sampled, context_tokens, attention_pairs].
    A negative coefficient of the three extra terms would make more work cheaper: that term is dropped and
    the rest refitted (an active set, at most three rounds)."""
    active = list(EXTRA_TERMS)
    weights = [1.0 / (s.seconds * s.seconds) if s.seconds > 0 else 0.0 for s in samples]
    extra = {
        "per_sampled_s": lambda s: float(s.num_sampled),
        "per_context_token_s": lambda s: float(s.context_tokens),
        "per_attention_pair_s": lambda s: float(s.attention_pairs),
    }
    while True:
        rows = [_tents(s.num_tokens, knots) + [extra[name](s) for name in active] for s in samples]
        coef = _lstsq(rows, [s.seconds for s in samples], weights)
        values = dict(zip(active, coef[len(knots) :], strict=True))
        negative = [name for name, v in values.items() if v < 0]
        if not negative:
            break
        active.remove(min(negative, key=lambda name: values[name]))
    curve = tuple(zip(knots, coef[: len(knots)], strict=True))
    return StepTimeModel(
        overhead_s=0.0,
        per_token_s=0.0,
        per_context_token_s=values.get("per_context_token_s", 0.0),
        per_sampled_s=values.get("per_sampled_s", 0.0),
        per_attention_pair_s=values.get("per_attention_pair_s", 0.0),
        token_curve=curve,
    )


OUTLIER_MADS = 5.0  # a step this many median absolute deviations slower than the fit was preempted


def fit(samples: list[StepSample], token_curve: bool = True) -> tuple[StepTimeModel, dict]:
    """Fit a step-time model, then once more without the outliers: steps whose relative residual exceeds
    OUTLIER_MADS median absolute deviations. On a shared machine a step the OS descheduled is several times a
    normal one, and squared error lets a few of them pull every coefficient.

    token_curve=True (what `kvserve calibrate` uses): the curve model of the module docstring, when the
    samples span at least three knots; else, or with token_curve=False, the linear model
    [1, num_tokens, context_tokens] (absolute error, coefficients clamped at >= 0: a negative cost would let
    the simulator run faster with more work).
    Returns the model and residual statistics (over all samples, and how many were dropped)."""
    if len(samples) < 3:
        raise ValueError(f"need at least 3 profiled steps to fit, got {len(samples)}")
    knots = curve_knots(s.num_tokens for s in samples) if token_curve else []

    def solve(subset: list[StepSample]) -> StepTimeModel:
        return _fit_curve(subset, knots) if len(knots) >= 3 else _least_squares(subset)

    def rel_resid(model: StepTimeModel, s: StepSample) -> float:
        return (s.seconds - model.step_seconds(*s.work)) / s.seconds if s.seconds > 0 else 0.0

    model = solve(samples)
    resid = [rel_resid(model, s) for s in samples]
    med = sorted(resid)[len(resid) // 2]
    mad = sorted(abs(r - med) for r in resid)[len(resid) // 2]
    kept = [s for s, r in zip(samples, resid, strict=True) if abs(r - med) <= OUTLIER_MADS * mad] if mad > 0 else []
    if len(kept) >= max(3, len(knots) + len(EXTRA_TERMS)):
        model = solve(kept)
    else:
        kept = []
    rel = [abs(rel_resid(model, s)) for s in samples if s.seconds > 0]
    stats = {
        "num_samples": len(samples),
        "num_outliers_dropped": len(samples) - len(kept) if kept else 0,
        "mean_abs_rel_error": sum(rel) / len(rel) if rel else 0.0,
        "max_abs_rel_error": max(rel) if rel else 0.0,
        "model": "token_curve" if model.token_curve else "linear",
    }
    return model, stats

"""Step-time model: seconds for one engine step from what the step does.

One step's time is modelled as a linear sum of its phases:
  fixed host overhead (scheduling, sampling, launch)            -> overhead_s
  GEMM work, proportional to the tokens computed this step       -> per_token_s * num_tokens
  attention KV reads, proportional to the context tokens read    -> per_context_token_s * context_tokens
The coefficients come from a least-squares fit over profiled steps (`fit`), or from published peak FLOPs and
bandwidth with efficiency factors (`from_hardware`). Pure Python: no numpy, so the operator can use it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class StepSample:
    num_tokens: int  # tokens whose KV the step computed (prefill chunk tokens + one per decode)
    context_tokens: int  # sum over scheduled requests of the context each attends to
    seconds: float


def step_work(scheduled) -> tuple[int, int]:
    """(num_tokens, context_tokens) of one step's scheduled requests (SchedulerOutput.scheduled): the two
    variables of the model, counted the same way when calibrating on the engine and when simulating."""
    num_tokens = context_tokens = 0
    for s in scheduled:
        n = len(s.token_ids)
        num_tokens += n
        context_tokens += s.start_position + n
    return num_tokens, context_tokens


@dataclass(frozen=True)
class StepTimeModel:
    overhead_s: float
    per_token_s: float
    per_context_token_s: float

    def step_seconds(self, num_tokens: int, context_tokens: int) -> float:
        return self.overhead_s + self.per_token_s * num_tokens + self.per_context_token_s * context_tokens

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> StepTimeModel:
        return cls(float(d["overhead_s"]), float(d["per_token_s"]), float(d["per_context_token_s"]))

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


def _solve3(a: list[list[float]], b: list[float]) -> list[float]:
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


def _least_squares(samples: list[StepSample]) -> StepTimeModel:
    rows = [(1.0, float(s.num_tokens), float(s.context_tokens)) for s in samples]
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    atb = [sum(r[i] * s.seconds for r, s in zip(rows, samples, strict=True)) for i in range(3)]
    return StepTimeModel(*(max(0.0, c) for c in _solve3(ata, atb)))


OUTLIER_MADS = 5.0  # a step this many median absolute deviations slower than the fit was preempted


def fit(samples: list[StepSample]) -> tuple[StepTimeModel, dict]:
    """Least squares on [1, num_tokens, context_tokens] -> seconds (coefficients clamped at >= 0: a negative
    cost would let the simulator run faster with more work), then once more without the outliers: steps whose
    residual exceeds OUTLIER_MADS median absolute deviations. On a shared machine a step the OS descheduled
    is several times a normal one, and squared error lets a few of them pull every coefficient.
    Returns the model and residual statistics (over all samples, and how many were dropped)."""
    if len(samples) < 3:
        raise ValueError(f"need at least 3 profiled steps to fit, got {len(samples)}")
    model = _least_squares(samples)
    resid = [s.seconds - model.step_seconds(s.num_tokens, s.context_tokens) for s in samples]
    med = sorted(resid)[len(resid) // 2]
    mad = sorted(abs(r - med) for r in resid)[len(resid) // 2]
    kept = [s for s, r in zip(samples, resid, strict=True) if abs(r - med) <= OUTLIER_MADS * mad] if mad > 0 else []
    if len(kept) >= 3:
        model = _least_squares(kept)
    rel = [
        abs(model.step_seconds(s.num_tokens, s.context_tokens) - s.seconds) / s.seconds
        for s in samples
        if s.seconds > 0
    ]
    stats = {
        "num_samples": len(samples),
        "num_outliers_dropped": len(samples) - len(kept) if len(kept) >= 3 else 0,
        "mean_abs_rel_error": sum(rel) / len(rel) if rel else 0.0,
        "max_abs_rel_error": max(rel) if rel else 0.0,
    }
    return model, stats

"""A lower bound on the engine time one request costs, from the step-time model alone (no simulation).

The fleet search uses it to skip deployments that cannot be cheaper than one already found: a replica finishes
at most 1 / `min_request_seconds` requests per second (the simulator's clock is the sum of its steps' times, and
every request's tokens, sampled rows, context reads and query-key pairs are paid in some step), so it needs at
least ceil(peak x min_request_seconds) replicas whatever its engine settings. The bound uses the cheapest a token
can be in any step (the GEMM curve's smallest cost per token over 1..max_num_batched_tokens) and the shortest
lengths of the workload, so it never exceeds what the simulation would charge.
"""

from __future__ import annotations

import math

from kvserve.runtime.planner.simulator import Workload
from kvserve.runtime.planner.step_time import StepTimeModel


def cheapest_token_seconds(model: StepTimeModel, max_num_batched_tokens: int) -> float:
    """min over 1 <= T <= max_num_batched_tokens of token_seconds(T) / T. token_seconds is linear between the
    curve's knots (and beyond them), so on each piece a/T + b is monotone and the minimum lies at a knot or an end."""
    ends = {1, max_num_batched_tokens} | {t for t, _ in model.token_curve if 1 <= t <= max_num_batched_tokens}
    return max(0.0, min(model.token_seconds(t) / t for t in ends))


def min_request_seconds(
    model: StepTimeModel, workload: Workload, max_num_batched_tokens: int, max_model_len: int
) -> float:
    """The least engine time any request of `workload` can cost (see the module docstring). Prompt tokens of the
    shared prefix may come from the prefix cache, so only the rest is charged as computed tokens."""
    prompt = min(workload.prompt_len.lo, max_model_len - 1)
    output = max(1, min(workload.output_len.lo, max_model_len - prompt))  # a sequence stops at max_model_len
    cached = min(workload.prefix_len, prompt - 1)
    computed = (prompt - cached) + (output - 1)  # the prompt's uncached tokens, then one token per later decode
    decodes = range(1, output)
    context = prompt + sum(prompt + i for i in decodes)  # a prefill's chunks read >= the prompt; decode i, prompt + i
    pairs = (prompt * (prompt + 1) - cached * (cached + 1)) // 2 + sum(prompt + i for i in decodes)
    return (
        computed * cheapest_token_seconds(model, max_num_batched_tokens)
        + output * model.per_sampled_s
        + context * model.per_context_token_s
        + pairs * model.per_attention_pair_s
    )


def min_replicas(peak_requests_per_s: float, request_seconds: float) -> int:
    """Replicas that serve the peak rate at the most, given each request's least engine time (at least one)."""
    return max(1, math.ceil(peak_requests_per_s * request_seconds - 1e-9))

"""Turn logits into tokens: logprobs from the raw logits, then (vLLM V1 order) min-tokens masking,
penalties (repetition, frequency, presence), and greedy argmax or temperature -> min_p -> top-k -> top-p
-> multinomial with the request's own generator (a per-request seed reproduces regardless of batching).

Per-request fault isolation: whatever is specific to one request (its generator, penalties, min-tokens
masking, sampling, logprobs) runs under its own guard; if it raises, only that request is reported failed
(`sample`'s third result) and the batch's other rows are sampled as usual."""

from __future__ import annotations

import logging

import torch

from kvserve.runtime.core.outputs import TokenLogprobs
from kvserve.runtime.sampling_params import SamplingParams
from kvserve.runtime.structured_output.constraint import GrammarConstraint, apply_constraints

logger = logging.getLogger("kvserve.sampling")


class RequestSamplingState:
    """What the sampler keeps per request across steps (and across preemption)."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: list[int],
        eos_token_ids: tuple[int, ...],
        device: torch.device,
        default_generator: torch.Generator | None,
    ):
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.generator = default_generator
        self.error: str | None = None  # set when this request cannot be sampled; sample() then fails it alone
        if params.seed is not None:
            try:
                self.generator = torch.Generator(device=device)
                self.generator.manual_seed(params.seed)
            except Exception:  # noqa: BLE001 -- e.g. a seed outside int64 that slipped past validation
                logger.exception("seeding the sampler failed (seed=%r)", params.seed)
                self.error = "seeding the sampler"
        # Tokens that end the sequence; masked while fewer than min_tokens have been produced.
        self.stop_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
        if params.structured_outputs is not None and params.compiled_constraint is None:
            raise ValueError("structured_outputs reached the sampler uncompiled (the edge compiles it)")
        self.constraint = (
            GrammarConstraint(params.compiled_constraint) if params.compiled_constraint is not None else None
        )


def is_plain_greedy(state: RequestSamplingState) -> bool:
    """sample() reduces to a bare argmax for this request on every step: greedy, nothing that edits its
    logits (penalties, min-tokens masking, a grammar), no logprobs, no setup error. The runner keeps the set
    of such requests so an all-plain batch skips sample()'s per-request passes."""
    p = state.params
    return (
        state.error is None
        and p.greedy
        and not p.uses_penalties
        and not (p.min_tokens and state.stop_ids)
        and state.constraint is None
        and p.logprobs is None
    )


def sample(
    logits: torch.Tensor, states: list[RequestSamplingState]
) -> tuple[list[int | None], list[TokenLogprobs | None], dict[int, str]]:
    """logits: [rows, vocab] float32, one row per state. Returns token ids (None for a failed row), logprobs
    (if asked) and {row: what failed} for rows whose own processing raised."""
    failed: dict[int, str] = {i: s.error for i, s in enumerate(states) if s.error is not None}

    def guarded(i: int, stage: str, fn, *args):
        try:
            return fn(*args)
        except Exception:  # noqa: BLE001 -- one request's failure must not fail the batch
            logger.exception("%s failed for one request; failing it alone", stage)
            failed[i] = stage
            return None

    raw_logprobs = None
    if any(s.params.logprobs is not None for s in states):
        raw_logprobs = torch.log_softmax(logits, dim=-1)

    processed = logits
    needs_processing = [
        i
        for i, s in enumerate(states)
        if i not in failed
        and (
            s.params.uses_penalties
            or (s.params.min_tokens and s.stop_ids and len(s.output_token_ids) < s.params.min_tokens)
        )
    ]
    if needs_processing:
        processed = logits.clone()
        for i in needs_processing:
            guarded(i, "applying penalties", _apply_penalties_and_min_tokens, processed[i], states[i])

    constrained = [(i, s.constraint) for i, s in enumerate(states) if s.constraint is not None and i not in failed]
    if constrained:
        processed = processed.clone() if processed is logits else processed
        apply_constraints(processed, constrained)
        # min_tokens may have masked the stop token the grammar now requires: the grammar wins.
        dead = [(i, c) for i, c in constrained if not torch.isfinite(processed[i]).any()]
        if dead:
            for i, _ in dead:
                processed[i] = logits[i]
            apply_constraints(processed, dead)

    tokens: list[int | None] = processed.argmax(dim=-1).tolist()  # greedy rows done; sampled rows below
    for i, state in enumerate(states):
        if not state.params.greedy and i not in failed:
            tokens[i] = guarded(i, "sampling", _sample_row, processed[i], state.params, state.generator)

    for i, constraint in constrained:
        if i not in failed:
            guarded(i, "advancing the grammar", constraint.accept, tokens[i])

    logprobs: list[TokenLogprobs | None] = [None] * len(states)
    for i, state in enumerate(states):
        if i in failed or state.params.logprobs is None:
            continue
        logprobs[i] = guarded(
            i, "computing logprobs", _token_logprobs, raw_logprobs[i], tokens[i], state.params.logprobs
        )
    for i, state in enumerate(states):
        if i in failed:
            tokens[i], logprobs[i] = None, None
        else:
            state.output_token_ids.append(tokens[i])
    return tokens, logprobs, failed


def _token_logprobs(row: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    token_logprob = row[token_id]
    rank = int((row > token_logprob).sum().item()) + 1
    top = []
    if num_top > 0:
        values, ids = row.topk(num_top)
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprobs(token_id, float(token_logprob), rank, top)


def _apply_penalties_and_min_tokens(row: torch.Tensor, state: RequestSamplingState) -> None:
    params = state.params
    if params.min_tokens and len(state.output_token_ids) < params.min_tokens and state.stop_ids:
        row[state.stop_ids] = float("-inf")
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(
            sorted(set(state.prompt_token_ids) | set(state.output_token_ids)), device=row.device, dtype=torch.long
        )
        values = row[seen]
        row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if state.output_token_ids and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(state.output_token_ids, device=row.device), minlength=row.shape[0])
        counts = counts[: row.shape[0]].to(row.dtype)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)


def _sample_row(row: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(sampling_probs(row, params), 1, generator=generator).item())


def sampling_probs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from: temperature -> min_p -> top-k -> top-p (unnormalised
    after the filters; multinomial and the speculative verifier normalise)."""
    probs = torch.softmax(row / params.temperature, dim=-1)
    if params.min_p > 0:
        probs = torch.where(probs < params.min_p * probs.max(), 0.0, probs)
    if params.top_k > 0 and params.top_k < probs.shape[0]:
        kth = probs.topk(params.top_k).values[-1]
        probs = torch.where(probs < kth, 0.0, probs)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(0) / sorted_probs.sum()
        # Keep the smallest set whose mass reaches top_p (the first token always stays).
        drop = (cumulative - sorted_probs / sorted_probs.sum()) >= params.top_p
        drop[0] = False  # explicitly: a top_p below float32's smallest value compares as 0 (found by fuzzing)
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs

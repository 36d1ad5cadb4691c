"""Verify draft tokens against the target model's logits (one row per draft, plus one after the last).

Greedy: accept drafts while each equals the target's argmax at its position; the first mismatch is replaced
by the argmax, and if all match the argmax after the last draft is the bonus token -- so greedy output is
exactly what one-token-at-a-time decoding gives.

Sampling (arXiv 2211.17192, Leviathan et al.): n-gram and suffix drafts are deterministic, so the draft
distribution q is one-hot at the draft d. Accept d with probability min(1, p(d)/q(d)) = p(d); on rejection
sample from the residual normalise(max(p - q, 0)) = p with d removed; after all accepted, sample the bonus
from p at the next position. Each emitted token is then distributed exactly as p (the test checks it).

A draft model's sampled drafts come with their q (ScheduledRequest.spec_draft_probs): acceptance is then
min(1, p(d)/q(d)) and the residual max(p - q, 0), which accepts more than the one-hot rule for the same
drafts. (The one-hot rule, and the sequential "sample from p and compare" path, stay exact for a draft drawn
from any q independently of the verifier's randomness -- they only accept less.)
"""

from __future__ import annotations

import logging

import torch

from kvserve.runtime.core.outputs import TokenLogprobs
from kvserve.runtime.sampling import RequestSamplingState, is_plain_greedy, sample, sampling_probs

logger = logging.getLogger("kvserve.spec_decode")


def verify(
    logits: torch.Tensor,
    drafted: list[tuple[str, list[int], int]],
    states: dict[str, RequestSamplingState],
    logprobs_out: dict[str, list[TokenLogprobs]] | None = None,
    draft_probs: dict | None = None,
) -> tuple[dict[str, list[int]], dict[str, str]]:
    """logits: [rows, vocab]; drafted: (request id, its drafts, index of its first row) with len(drafts) + 1
    rows each. Returns (tokens per request, {request id: what failed}); logprobs_out receives the emitted
    tokens' logprobs of requests that asked for them. draft_probs: request id -> its draft's q rows
    ([len(drafts), vocab], a draft model's sampled drafts); the other drafts are one-hot."""
    out: dict[str, list[int]] = {}
    failed: dict[str, str] = {}
    sequential = [d for d in drafted if _needs_sequential(states[d[0]])]
    for rid, drafts, first in sequential:
        tokens, lps = [], []
        for i in range(len(drafts) + 1):
            # sample() applies this request's penalties, min_tokens masking, grammar and logprobs at this
            # position, then appends the token to its history / advances its grammar, so the next row is
            # processed in the state the emitted tokens left. With a one-hot draft, "sample from p, go on while
            # the sample equals the draft" is exactly rejection sampling (P(accept) = p(d); a mismatch is
            # distributed as p without d); for greedy it is "argmax equals the draft".
            row_tokens, row_lps, row_failed = sample(logits[first + i : first + i + 1], [states[rid]])
            if row_failed:
                failed[rid] = row_failed[0]
                break
            tokens.append(row_tokens[0])
            lps.append(row_lps[0])
            state = states[rid]
            ended = row_tokens[0] in state.stop_ids or (state.constraint is not None and state.constraint.terminated)
            if i == len(drafts) or row_tokens[0] != drafts[i] or ended:  # (nothing follows an end)
                break
        if rid not in failed:
            out[rid] = tokens
            if logprobs_out is not None and states[rid].params.logprobs is not None:
                logprobs_out[rid] = lps
    done = {d[0] for d in sequential}
    drafted = [d for d in drafted if d[0] not in done]
    greedy = [d for d in drafted if states[d[0]].params.greedy]
    if greedy:
        index = torch.tensor([first + i for _, drafts, first in greedy for i in range(len(drafts) + 1)])
        targets = logits[index.to(logits.device)].argmax(dim=-1).tolist()
        offset = 0
        for rid, drafts, _ in greedy:
            row_targets = targets[offset : offset + len(drafts) + 1]
            offset += len(drafts) + 1
            out[rid] = accept_greedy(drafts, row_targets)
    for rid, drafts, first in drafted:
        state = states[rid]
        if state.params.greedy:
            continue
        try:
            q = (draft_probs or {}).get(rid)
            if q is not None:
                q = torch.as_tensor(q, device=logits.device)
            out[rid] = accept_sampled(logits[first : first + len(drafts) + 1], drafts, state, q)
        except Exception:  # noqa: BLE001 -- one request's failure must not fail the batch
            logger.exception("verifying drafts failed for one request; failing it alone")
            failed[rid] = "verifying speculative tokens"
    for rid, _, _ in drafted:  # (sample() already recorded the sequential ones)
        if rid in out:
            states[rid].output_token_ids.extend(out[rid])
    return out, failed


def _needs_sequential(state: RequestSamplingState) -> bool:
    """Requests whose processing of a row depends on the tokens emitted before it in the same step
    (penalties, min_tokens, a grammar) or that return logprobs: verified one position at a time."""
    p = state.params
    return not is_plain_greedy(state) and (
        p.uses_penalties or p.min_tokens or state.constraint is not None or p.logprobs is not None or state.error
    )


def accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """targets: the argmax at each draft's position and after the last one (len(drafts) + 1)."""
    tokens = []
    for draft, target in zip(drafts, targets):
        tokens.append(target)
        if target != draft:
            return tokens
    tokens.append(targets[len(drafts)])
    return tokens


def accept_sampled(
    rows: torch.Tensor, drafts: list[int], state: RequestSamplingState, draft_probs: torch.Tensor | None = None
) -> list[int]:
    """draft_probs: q at each draft's position ([len(drafts), vocab], normalised), None for one-hot drafts."""
    params, generator = state.params, state.generator
    tokens = []
    for i, draft in enumerate(drafts):
        probs = sampling_probs(rows[i], params)
        probs = probs / probs.sum()
        if draft_probs is not None:
            token = _accept_with_q(probs, draft_probs[i].to(probs.dtype), draft, generator)
            tokens.append(token)
            if token != draft:
                return tokens
            continue
        if torch.rand((), generator=generator, device=probs.device).item() < probs[draft].item():
            tokens.append(draft)
            continue
        probs[draft] = 0.0
        if not probs.sum() > 0:  # p(d) rounded to 1 but u landed above it: nothing else has mass
            tokens.append(draft)
            continue
        tokens.append(int(torch.multinomial(probs, 1, generator=generator).item()))
        return tokens
    bonus = sampling_probs(rows[len(drafts)], params)
    tokens.append(int(torch.multinomial(bonus, 1, generator=generator).item()))
    return tokens


def _accept_with_q(p: torch.Tensor, q: torch.Tensor, draft: int, generator: torch.Generator | None) -> int:
    """One position with a draft d ~ q: keep d with probability min(1, p(d)/q(d)), else draw from the residual
    normalise(max(p - q, 0)); the result is distributed as p (Leviathan et al., Theorem 1)."""
    u = torch.rand((), generator=generator, device=p.device).item()
    if u * q[draft].item() < p[draft].item():  # u < p/q without dividing (q(d) > 0: d was drawn from q)
        return draft
    residual = (p - q).clamp_(min=0.0)
    if not residual.sum() > 0:  # p == q up to rounding: rejection had probability ~0, keep the draft
        return draft
    return int(torch.multinomial(residual, 1, generator=generator).item())

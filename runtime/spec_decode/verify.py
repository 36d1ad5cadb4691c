"""Verify draft tokens against the target model's logits (one row per draft, plus one after the last).

Greedy: accept drafts while each equals the target's argmax at its position; the first mismatch is replaced
by the argmax, and if all match the argmax after the last draft is the bonus token -- so greedy output is
exactly what one-token-at-a-time decoding gives.

Sampling (arXiv 2211.17192, Leviathan et al.): n-gram and suffix drafts are deterministic, so the draft
distribution q is one-hot at the draft d. Accept d with probability min(1, p(d)/q(d)) = p(d); on rejection
sample from the residual normalise(max(p - q, 0)) = p with d removed; after all accepted, sample the bonus
from p at the next position. Each emitted token is then distributed exactly as p (the test checks it).
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
) -> tuple[dict[str, list[int]], dict[str, str]]:
    """logits: [rows, vocab]; drafted: (request id, its drafts, index of its first row) with len(drafts) + 1
    rows each. Returns (tokens per request, {request id: what failed}); logprobs_out receives the emitted
    tokens' logprobs of requests that asked for them."""
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
            out[rid] = accept_sampled(logits[first : first + len(drafts) + 1], drafts, state)
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


def accept_sampled(rows: torch.Tensor, drafts: list[int], state: RequestSamplingState) -> list[int]:
    params, generator = state.params, state.generator
    tokens = []
    for i, draft in enumerate(drafts):
        probs = sampling_probs(rows[i], params)
        probs = probs / probs.sum()
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

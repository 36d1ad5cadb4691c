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

from kvserve.runtime.sampling import RequestSamplingState, sampling_probs

logger = logging.getLogger("kvserve.spec_decode")


def verify(
    logits: torch.Tensor, drafted: list[tuple[str, list[int], int]], states: dict[str, RequestSamplingState]
) -> tuple[dict[str, list[int]], dict[str, str]]:
    """logits: [rows, vocab]; drafted: (request id, its drafts, index of its first row) with len(drafts) + 1
    rows each. Returns (tokens per request, {request id: what failed})."""
    out: dict[str, list[int]] = {}
    failed: dict[str, str] = {}
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
    for rid, tokens in out.items():
        states[rid].output_token_ids.extend(tokens)
    return out, failed


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

"""Per-request grammar state inside the sampler: fill a token bitmask for the constrained rows of a step,
mask their logits, and advance each matcher with the sampled token.

The matcher lives in the runner's RequestSamplingState, which survives preemption (recompute only rebuilds
KV; the tokens the matcher accepted are still the sequence's tokens), so no rollback is needed there."""

from __future__ import annotations

import torch

from kvserve.runtime.structured_output.compiler import CompiledConstraint


class GrammarConstraint:
    def __init__(self, compiled: CompiledConstraint):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled.grammar)
        self.vocab_size = compiled.model_key[1]

    def accept(self, token_id: int) -> None:
        if not self.matcher.accept_token(token_id):
            raise RuntimeError(f"token {token_id} violates the request's grammar")

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


def apply_constraints(logits: torch.Tensor, constrained: list[tuple[int, GrammarConstraint]]) -> None:
    """Mask, in place, every token the grammar forbids in the given rows of [rows, vocab] float logits."""
    import xgrammar as xgr

    if not constrained:
        return
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], constrained[0][1].vocab_size)
    for row, constraint in constrained:
        constraint.matcher.fill_next_token_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=[row for row, _ in constrained])

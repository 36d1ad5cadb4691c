"""Batched LoRA delta for a mixed batch, as Punica does it: every token carries a slot index (-1 = base model,
no delta); adapters live in fixed device slots padded to max_rank. A step with many tokens per adapter
(prefill) runs one GEMM pair per adapter over its tokens (segmented, SGMV); a step with few (decode of many
adapters) gathers each token's A and B into one batched matmul pair (BGMV). Never merges adapter weights
into the base weight."""

from __future__ import annotations

import torch


class LoraSlots:
    """Device-resident stacks for one target module: A [slots, max_rank, in], B [slots, out, max_rank].
    A slot's rank tail is zero, so a smaller rank contributes exactly its own product; scaling is folded
    into B at load time."""

    def __init__(self, num_slots: int, max_rank: int, in_features: int, out_features: int, dtype, device=None):
        self.a = torch.zeros(num_slots, max_rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, out_features, max_rank, dtype=dtype, device=device)

    def set(self, slot: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        r = a.shape[0]
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.a[slot, :r] = a.to(self.a.dtype)
        self.b[slot, :, :r] = (b.float() * scaling).to(self.b.dtype)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()


# Below this many tokens per distinct adapter the per-token gather wins (decode steps: one launch pair for the
# whole mix); above it one GEMM pair per adapter does (prefill: the gather would copy A and B once per token).
SEGMENT_MIN_TOKENS_PER_ADAPTER = 4


def lora_delta(x: torch.Tensor, token_slots: torch.Tensor, slots: LoraSlots) -> torch.Tensor | None:
    """x [tokens, in], token_slots [tokens] int64 (-1 = base). Returns the [tokens, out] delta, or None
    when no token uses an adapter (the base-only batch pays nothing)."""
    active = token_slots >= 0
    if not bool(active.any()):
        return None
    idx = active.nonzero(as_tuple=True)[0]
    s = token_slots[idx]
    out = torch.zeros(x.shape[0], slots.b.shape[1], dtype=x.dtype, device=x.device)
    used = torch.unique(s)
    if idx.numel() >= SEGMENT_MIN_TOKENS_PER_ADAPTER * used.numel():
        # Segmented (SGMV-style): each adapter's tokens through its own A then B, two plain GEMMs.
        for slot in used.tolist():
            rows = idx[s == slot]
            xa = x[rows].to(slots.a.dtype) @ slots.a[slot].T  # [n, rank]
            out.index_copy_(0, rows, (xa @ slots.b[slot].T).to(x.dtype))  # [n, out]
        return out
    # Gathered (BGMV-style): every token's own A and B, one batched matmul pair for the whole mix.
    xa = torch.bmm(slots.a[s], x[idx].unsqueeze(-1).to(slots.a.dtype))  # [n, rank, 1]
    d = torch.bmm(slots.b[s], xa).squeeze(-1)  # [n, out]
    out.index_copy_(0, idx, d.to(x.dtype))
    return out

"""Kernel-test helpers (tests/ is on pytest's pythonpath; nothing shipped imports this): the independent
attention oracle the paged kernels are checked against. The random batches themselves are the benchmarks'
(kvserve.runtime.bench.paged_batch), so a test and a benchmark run the same inputs."""

from __future__ import annotations

import torch

from kvserve.runtime.bench.paged_batch import PagedBatch


def dense_causal_attention(batch: PagedBatch) -> torch.Tensor:
    """Attention from the contiguous per-sequence K/V (no block table at all): an independent oracle."""
    q = batch.q.float()
    out = torch.full_like(q, float("nan"))
    group = q.shape[1] // batch.k_full[0].shape[1] if batch.k_full else 1
    cu = batch.cu_seqlens_q.tolist()
    for s, (kf, vf) in enumerate(zip(batch.k_full, batch.v_full)):
        qs = q[cu[s] : cu[s + 1]]
        ql, n = qs.shape[0], kf.shape[0]
        if ql == 0:
            continue
        kk = kf.to(q.device).repeat_interleave(group, 1)
        vv = vf.to(q.device).repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, kk) * batch.scale
        mask = torch.ones(ql, n, dtype=torch.bool, device=q.device).tril(n - ql)
        scores = scores.masked_fill(~mask, float("-inf"))
        out[cu[s] : cu[s + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)
    return out

"""fp32 CPU linears on weights kept in panels of 32 output columns (kvkernels/cpu/panel_linear.cpp).

Why: a decode step's linears read every weight once from memory for a few to a hundred rows, and oneDNN's fp32
GEMM does not overlap that stream with its arithmetic. The panel kernel prefetches the weights ahead of its FMAs
(tools/panel_linear_ab.py; docs/performance.md has the table: 1.2-1.5x faster than oneDNN at 1-128 rows on the
2-core Sapphire Rapids).

One copy of the weight: the panels replace oneDNN's packed weight. Above `MAX_KERNEL_ROWS` rows (prefill) the work
is compute-bound and torch's batched GEMM over the panels runs at 96-98% of oneDNN's speed, in chunks of
`CHUNK_ROWS` rows so each chunk's rows stay in cache across the panels.

Numerics: the kernel sums each output as one FMA chain over k, independent of the batch; the batched GEMM sums in
that library's order. Either differs from oneDNN's fp32 in the last bits only, as any two GEMM libraries do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PANEL = 32  # output columns per panel: the kernel's two 16-float vectors
# Rows up to which the kernel runs; above, the batched GEMM. Measured on the 2-core Sapphire Rapids over SmolLM2's
# projections: the kernel 75 ms vs oneDNN 83 ms at 128 rows, level at 256, 15-20% slower from 512.
MAX_KERNEL_ROWS = 128
CHUNK_ROWS = 512


@dataclass(frozen=True)
class PanelWeight:
    panels: torch.Tensor  # float32 [ceil(N / 32), K, 32], zero past N
    out_features: int


def usable(weight: torch.Tensor) -> bool:
    """Whether `weight` goes into panels here: a 2-D fp32 CPU weight, with the compiled ops vectorised on this CPU."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return False
    from kvserve.kernels import cpu_ops

    return cpu_ops.load() and bool(torch.ops.kvserve_cpu.panel_linear_native())


def pack(weight: torch.Tensor) -> PanelWeight:
    """[N, K] -> panels [ceil(N / 32), K, 32]."""
    n, k = weight.shape
    padded = weight.detach().contiguous()
    if n % PANEL:  # F.pad copies even when it adds nothing: only pad when needed (a 7B fp32 model is 28 GB)
        padded = F.pad(padded, (0, 0, 0, -n % PANEL))
    return PanelWeight(padded.view(-1, PANEL, k).transpose(1, 2).contiguous(), n)


def apply(x: torch.Tensor, w: PanelWeight, bias: torch.Tensor | None) -> torch.Tensor:
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, n = rows.shape[0], w.out_features
    if m <= MAX_KERNEL_ROWS:
        out = rows.new_empty(m, n)
        torch.ops.kvserve_cpu.panel_linear(out, rows, w.panels, bias)
    else:
        out = _batched(rows, w, bias)
    return out.view(*x.shape[:-1], n)


def _batched(rows: torch.Tensor, w: PanelWeight, bias: torch.Tensor | None) -> torch.Tensor:
    m, num_panels = rows.shape[0], w.panels.shape[0]
    out = rows.new_empty(m, num_panels, PANEL)
    for start in range(0, m, CHUNK_ROWS):
        chunk = rows[start : start + CHUNK_ROWS]
        out[start : start + chunk.shape[0]].copy_(torch.matmul(chunk, w.panels).transpose(0, 1))
    out = out.view(m, num_panels * PANEL)
    if out.shape[1] != w.out_features:
        out = out[:, : w.out_features].contiguous()
    if bias is not None:
        out += bias
    return out

"""Online FP8 weight quantisation (`--dtype fp8`, vLLM's `--quantization fp8` idea).

Every linear layer's weight is held as float8_e4m3fn with one fp32 scale per output channel (row):
W ~= diag(scale) @ W_fp8, scale = amax(|row|) / 448. Embeddings, the LM head, norms and biases stay in the
activation dtype (capacity.FP8_ACTIVATION_DTYPE). This is exactly what kvserve.runtime.capacity charges
(`weight_bytes_per_rank(..., "fp8", t)`), so the planner's weight bytes equal the allocation.

Quantisation happens row block by row block *while the checkpoint is read* (quantize_into), so a rank never
holds a 16-bit copy of a whole weight matrix: a model planned at 1 byte per parameter loads in that memory.
Per-row scales make this exact for fused parameters (QKV, gate/up): each checkpoint tensor fills its own rows.

Two matmuls:
- "dequant" (default; CPU and GPUs without FP8 tensor cores): y = x @ (scale * W_fp8)^T, the weight
  dequantised to the activation dtype on the fly (weight-only: activations keep full precision);
- "scaled_mm" (CUDA with compute capability >= 8.9: Ada, Hopper, Blackwell): activations quantised per token
  at run time and torch._scaled_mm with row-wise scales on both sides (W8A8, FP8 tensor cores).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_MIN_SCALE = 1e-12


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, cols] -> (float8 [rows, cols], fp32 scale [rows]) with w ~= scale[:, None] * q."""
    w = w.float()
    scale = (w.abs().amax(dim=-1) / FP8_MAX).clamp(min=_MIN_SCALE)
    q = (w / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def convert_linears(model: nn.Module, linear_types: tuple[type, ...]) -> int:
    """Before materialisation (meta device): give every linear of `linear_types` an fp8 weight and an fp32
    per-row scale buffer. Returns how many were converted."""
    count = 0
    for module in model.modules():
        if isinstance(module, linear_types):
            weight = module.weight
            module.weight = nn.Parameter(
                torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device), requires_grad=False
            )
            module.register_buffer(
                "weight_scale",
                torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device),
                persistent=False,
            )
            count += 1
    return count


def quantize_into(weight: torch.Tensor, scales: torch.Tensor, index: tuple, piece: torch.Tensor) -> None:
    """Load a checkpoint piece into weight[index] (float8; index () = all of it), quantising each row with its
    own scale into scales[index] (scales has weight's leading dims: one per output row, per expert for MoE)."""
    q, scale = quantize_rows(piece.to(scales.device))
    (weight[index] if index else weight).copy_(q)
    (scales[index] if index else scales).copy_(scale)


def _use_scaled_mm(x: torch.Tensor) -> bool:
    choice = os.environ.get("KVSERVE_FP8_MATMUL", "auto")
    if choice != "auto":
        return choice == "scaled_mm"
    return x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9)


def fp8_linear(x: torch.Tensor, module: nn.Module, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x @ (scale * W_fp8)^T (+ bias), in x's dtype."""
    weight, scale = module.weight, module.weight_scale
    if _use_scaled_mm(x):
        x2 = x.reshape(-1, x.shape[-1])
        x_scale = (x2.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=_MIN_SCALE)
        xq = (x2.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.unsqueeze(0), out_dtype=x.dtype)
        y = y.reshape(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias
    # fp8 x fp32 scale rounds to the activation dtype's 8+ mantissa bits almost exactly: one rounding, one matmul.
    return F.linear(x, weight.to(x.dtype) * scale.to(x.dtype).unsqueeze(-1), bias)

"""Linears with prepacked weights for models on CPU: fp32 in kvserve's panel kernel, bf16 on oneDNN.

Why: `F.linear` on CPU runs MKL's SGEMM in fp32 (70-150 GFLOP/s on the 2-core EPYC this was measured on) and
oneDNN's bf16 brgemm on an unpacked weight; the same oneDNN primitive on a weight reordered once into its
blocked layout (`torch.ops.mkldnn._reorder_linear_weight`) runs 2.5-3x faster in fp32 at the batch sizes a
decode step has and 1.0-1.4x faster in bf16 (docs/performance.md has the measurements).

How: after the checkpoint is loaded, `pack_linears` gives every column/row-parallel linear (and the LM head)
an opaque packed weight and moves its plain `weight` to the meta device: the parameter keeps its shape and
dtype (weight accounting is unchanged) but no longer holds memory, and any code that still tried to compute
with it would fail loudly instead of reading stale values. A tied LM head keeps the embedding's weight and
packs a copy. `linear(x, module, bias)` then runs the packed primitive, or `F.linear` for a module that was
not packed (GPU, fp16, fp8 weights, the MoE router, oneDNN unavailable).

fp32 weights go into panels instead (models/panel_linear.py) where the compiled CPU ops run vectorised: one copy
of the weight, decode rows in kvserve's own kernel (it overlaps the weight stream with the arithmetic, which
oneDNN's fp32 GEMM does not), prefill rows in torch's batched GEMM over the panels.

`KVSERVE_CPU_LINEAR`: `auto` (the default: panels for fp32, oneDNN for bf16), `onednn` (oneDNN for every dtype,
the previous behaviour, for comparisons), `aten` (no packing: plain `F.linear`).

Numerics: oneDNN and MKL sum in different orders, so fp32 results differ in the last bits (bf16 outputs came
out identical in the measurement); greedy parity with transformers is tested on the parity models.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.runtime.models import panel_linear

logger = logging.getLogger("kvserve.models")

PACKED_DTYPES = (torch.float32, torch.bfloat16)
_ATTR = "packed_weight"  # a plain attribute, not a parameter or buffer: state_dict and .to() never see it
_PANELS = "panel_weight"  # the same, for fp32 weights in panels (models/panel_linear.py)
ENV = "KVSERVE_CPU_LINEAR"
MODES = ("auto", "onednn", "aten")


def mode() -> str:
    value = os.environ.get(ENV, "auto")
    if value not in MODES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(MODES)}")
    return value


def packing_enabled() -> bool:
    return mode() != "aten" and torch.backends.mkldnn.is_available()


def linear(x: torch.Tensor, module: nn.Module, bias: torch.Tensor | None) -> torch.Tensor:
    state = module.__dict__
    panels = state.get(_PANELS)
    if panels is not None:
        return panel_linear.apply(x, panels, bias)
    packed = state.get(_ATTR)
    if packed is None:
        return F.linear(x, module.weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_weight(module: nn.Module, weight: torch.Tensor, free_original: bool) -> bool:
    """Give `module` a packed copy of `weight` ([out, in]); with free_original, `module.weight` then lives on
    the meta device. False (nothing changed) when the weight cannot be packed."""
    if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES or weight.dim() != 2:
        return False
    if mode() == "auto" and panel_linear.usable(weight):
        module.__dict__[_PANELS] = panel_linear.pack(weight)
    else:
        module.__dict__[_ATTR] = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    if free_original:
        module.weight = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"), requires_grad=False)
    return True


@torch.no_grad()
def pack_linears(model: nn.Module, linear_types: tuple[type, ...]) -> int:
    """Pack every module of `linear_types` in `model`, and the LM head (`model.lm_head`, or a copy of the
    tied embedding as `model.tied_lm_head`). Returns how many weights were packed (0: none, e.g. on GPU)."""
    if not packing_enabled():
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, linear_types) and getattr(module, "weight", None) is not None:
            count += pack_weight(module, module.weight, free_original=True)
    head = getattr(model, "lm_head", None)
    if head is None and getattr(model, "embed_tokens", None) is not None:
        count += pack_weight(model.embed_tokens, model.embed_tokens.weight, free_original=False)
    if count:
        dtype = next((p.dtype for p in model.parameters()), None)
        panels = sum(_PANELS in m.__dict__ for m in model.modules())
        logger.info(
            "CPU linears: %s (%d weights, %s); %s=onednn or =aten changes this",
            "fp32 weights in panels for kvserve's kernel" if panels else "oneDNN with prepacked weights",
            count,
            str(dtype).removeprefix("torch."),
            ENV,
        )
    return count

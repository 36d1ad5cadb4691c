"""Greedy tokens straight from the LM head on CPU, for steps where every row samples plainly greedy
(sampling.is_plain_greedy: no logprobs, penalties, grammar, ...); other steps compute full fp32 logits as before.

bf16 / fp16 models (`HeadArgmax`): the argmax of the head's own output, with no fp32 copy of the logits first
(exact: widening is exact). At 128 rows of SmolLM2's 49,152-token vocabulary, head and argmax took 9.4 ms with the
copy and 7.6 ms without, one thread (tools/greedy_head_ab.py).

fp32 models (`ScreenedGreedyHead`): the fp32 answer for about the price of a bf16 head.
Why: in fp32 on CPU the LM head is the largest GEMM of a decode step (SmolLM2's tied 49,152 x 576 head is a fifth
of its weights) and a greedy request needs only its argmax. On the 2-vCPU Sapphire Rapids, 2 threads, oneDNN
with packed weights: the fp32 head takes 4.6 ms at 24 rows and 18.6 ms at 128; the same product on bf16 operands
1.1 and 2.9 ms (AMX).

How: `tokens(hidden)` runs the head once on bf16-rounded operands (a packed bf16 copy of the weight), then the
compiled op `screened_greedy_argmax` bounds, for every vocab row, how far that value can lie from the fp32 logit
(from the hidden state's and the row's L2 norms: kvkernels/cpu/screened_argmax.cpp has the derivation), keeps the
rows that could still be the maximum (a few of 49,152) and computes only those in fp32. The token is the fp32
argmax except where two survivors tie to the last bit, where any two fp32 GEMMs may break the tie differently.
A row with a non-finite value gets the full fp32 logits (torch.argmax's NaN rule).

Where: both need a single-rank model whose `compute_logits` is the plain head (`plain_lm_head`) and the compiled
CPU ops; the screen also needs native bf16 dot products (AMX or AVX512-BF16: elsewhere the bf16 GEMM is no
cheaper). The screen's memory: a bf16 copy of the head (half the fp32 head), plus, for an untied head, its plain
fp32 weight beside the packed one. `KVSERVE_CPU_SCREENED_HEAD=0` turns the screen off (fp32 then computes full
logits).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.runtime.models.cpu_linear import linear, pack_weight

logger = logging.getLogger("kvserve.models")

ENV_SWITCH = "KVSERVE_CPU_SCREENED_HEAD"
_NORM_ROWS_PER_CHUNK = 8192  # row norms in float64 a chunk at a time (a whole 128k x 8k head would need 8 GB)


class ScreenedGreedyHead:
    """weight: the head's plain fp32 [vocab, hidden] weight (kept by reference: a tied head's is the embedding)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.detach()
        if self.weight.dtype != torch.float32 or self.weight.dim() != 2 or self.weight.stride(-1) != 1:
            raise ValueError("ScreenedGreedyHead: weight must be float32 [vocab, hidden] with contiguous rows")
        # the head on bf16 operands, run by models/cpu_linear.py's `linear` (packed for oneDNN; the plain bf16 weight
        # is freed once packed)
        self.screen = nn.Module()
        self.screen.weight = nn.Parameter(self.weight.to(torch.bfloat16), requires_grad=False)
        pack_weight(self.screen, self.screen.weight, free_original=True)
        norms = torch.empty(self.weight.shape[0], dtype=torch.float32)
        for start in range(0, len(norms), _NORM_ROWS_PER_CHUNK):
            chunk = self.weight[start : start + _NORM_ROWS_PER_CHUNK].double().norm(dim=1)
            # rounded up, so the bound the op computes from them never undershoots
            norms[start : start + len(chunk)] = torch.nextafter(chunk.float(), torch.tensor(float("inf")))
        self.norms = norms

    @torch.no_grad()
    def tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """int64 [rows]: argmax(hidden @ weight.T, dim=-1) for float32 hidden [rows, hidden]."""
        hidden = hidden.float().contiguous()
        approx = linear(hidden.to(torch.bfloat16), self.screen, None)
        tokens = torch.ops.kvserve_cpu.screened_greedy_argmax(hidden, approx, self.weight, self.norms)
        unresolved = tokens < 0
        if bool(unresolved.any()):
            tokens[unresolved] = F.linear(hidden[unresolved], self.weight).argmax(dim=-1)
        return tokens


class HeadArgmax:
    """The head's output in the model's dtype and the compiled argmax over it."""

    def __init__(self, head: nn.Module):
        self.head = head

    @torch.no_grad()
    def tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.ops.kvserve_cpu.greedy_argmax(linear(hidden, self.head, None))


def bf16_dot_products_native() -> bool:
    """AMX or AVX512-BF16 on this CPU: oneDNN's bf16 GEMM then runs on bf16 hardware, not emulated."""
    from kvserve.kernels.cpu_ops import cpu_flags

    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


def for_model(model: nn.Module, world_size: int) -> ScreenedGreedyHead | HeadArgmax | None:
    """The greedy head for `model` where one applies (see the module docstring), else None. Call before the
    linears are packed: an untied head's plain weight is freed by packing."""
    if world_size != 1 or not getattr(model, "plain_lm_head", False) or not getattr(model, "fused_cpu_ops", False):
        return None
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    weight = getattr(head, "weight", None)
    if weight is None or weight.device.type != "cpu" or getattr(head, "lora_delta", None) is not None:
        return None
    if weight.dtype in (torch.bfloat16, torch.float16):
        return HeadArgmax(head)
    if weight.dtype != torch.float32 or os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    if not torch.backends.mkldnn.is_available() or not bf16_dot_products_native():
        return None
    screened = ScreenedGreedyHead(weight)
    logger.info(
        "greedy steps screen the fp32 LM head in bf16 and recompute its few candidate rows in fp32 "
        "(%d x %d; %s=0 turns this off)",
        *weight.shape,
        ENV_SWITCH,
    )
    return screened

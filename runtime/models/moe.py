"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks top-k experts per token, each a gated
SiLU MLP, and the token's output is the routing-weighted sum of its experts' outputs.

Numerics follow transformers: softmax over all experts in fp32, top-k, optional renormalisation, routing
weights kept in fp32 (Mixtral) or cast to the model dtype (Qwen3-MoE); each expert's output is multiplied by
its weight, cast to the activation dtype and accumulated in expert order.

`--dtype fp8` (runtime/models/fp8.py) quantises the experts like every other linear weight: float8 with one
fp32 scale per output row of each expert (`gate_up_proj_scale` [experts, 2 * intermediate], `down_proj_scale`
[experts, hidden]); the router stays in the activation dtype.

Tensor parallelism: every rank holds every expert, with each expert's intermediate dimension split like the
dense MLP's (gate/up column-parallel, down row-parallel). A rank's experts produce partial sums of the
output; one all-reduce per layer completes them (after the routing weights are applied -- they scale the
whole expert output, so they distribute over the partial sums). The router is replicated.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.runtime.models import fp8
from kvserve.runtime.models.parallel_layers import SINGLE, ParallelContext
from kvserve.runtime.models.registry import MoEShape


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, fp32_weights: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """[tokens, experts] logits -> (weights [tokens, top_k], expert ids [tokens, top_k])."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if fp32_weights else weights.to(router_logits.dtype)), ids


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Experts(nn.Module):
    """All experts' weights as two 3-D tensors (the layout transformers 5 uses in memory): gate_up_proj
    [experts, 2 * intermediate, hidden] (gate rows first) and down_proj [experts, hidden, intermediate], with
    `intermediate` this rank's slice."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        # Tokens routed to each expert, gathered once: one small matmul pair per expert that got any.
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        top_k = expert_ids.shape[-1]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            picks = order[start : start + n]  # flat (token, slot) indices, in token order
            start += n
            tokens = picks // top_k
            gate, up = self._linear(x[tokens], "gate_up_proj", e).split(self.intermediate, dim=-1)
            y = self._linear(F.silu(gate) * up, "down_proj", e)
            y = y * weights.reshape(-1)[picks, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out

    def _linear(self, x: torch.Tensor, name: str, expert: int) -> torch.Tensor:
        weight = getattr(self, name)[expert]
        if weight.dtype == fp8.FP8_DTYPE:
            return fp8.fp8_linear(
                x, SimpleNamespace(weight=weight, weight_scale=getattr(self, f"{name}_scale")[expert]), None
            )
        return F.linear(x, weight)


def convert_experts_to_fp8(model: nn.Module) -> int:
    """Before materialisation (meta device), as fp8.convert_linears does for the linears: float8 expert
    weights plus an fp32 scale per output row (the loader quantises each checkpoint piece into them)."""
    count = 0
    for module in model.modules():
        if isinstance(module, Experts):
            for name in ("gate_up_proj", "down_proj"):
                weight = getattr(module, name)
                setattr(
                    module,
                    name,
                    nn.Parameter(
                        torch.empty(weight.shape, dtype=fp8.FP8_DTYPE, device=weight.device), requires_grad=False
                    ),
                )
                module.register_buffer(
                    f"{name}_scale",
                    torch.empty(weight.shape[:-1], dtype=torch.float32, device=weight.device),
                    persistent=False,
                )
            count += 1
    return count


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden: int, moe: MoEShape, intermediate_local: int, parallel: ParallelContext = SINGLE):
        super().__init__()
        self.moe, self.parallel = moe, parallel
        self.gate = Router(hidden, moe.num_experts)
        self.experts = Experts(moe.num_experts, hidden, intermediate_local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.moe.top_k, self.moe.renormalize, self.moe.fp32_weights)
        return self.parallel.all_reduce(self.experts(x, ids, weights))

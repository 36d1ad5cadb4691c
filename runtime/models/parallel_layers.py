"""Tensor-parallel building blocks: the rank's process group, column/row-parallel linears and the
vocab-parallel embedding / LM head (Megatron-style).

With size == 1 every layer computes exactly what nn.Linear / nn.Embedding compute (same calls, no
collectives), so single-process numerics are unchanged. Parameters keep the names `weight` / `bias`, so the
model's parameter names match the checkpoint's whatever the split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.runtime.models.cpu_linear import linear
from kvserve.runtime.models.fp8 import FP8_DTYPE, fp8_linear


@dataclass
class ParallelContext:
    """This process's place in the tensor-parallel group. group=None with size 1: no collectives at all."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup (the default group when None and size > 1)
    # Pipeline parallelism: this rank's stage (models/pipeline_stage.PipelineStage), None without it. The
    # tensor-parallel group is then the stage's ranks (group), not the whole world.
    stage: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's x along the last dim on rank 0 (others get None): only rank 0 samples."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, group_dst=0, group=self.group)  # the group's rank 0 (a stage's first rank)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    def all_reduce_min(self, value: int) -> int:
        """The minimum over every rank of the world: tensor-parallel ranks and pipeline stages share one
        scheduler, hence one block count."""
        if self.size == 1 and self.stage is None:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


SINGLE = ParallelContext()


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's output rows split across ranks: each rank returns its slice of y, no
    communication. The row layout of the local shard is decided by the model's loader (fused QKV/gate-up)."""

    def __init__(self, in_features: int, out_features_local: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features_local, in_features))
        self.bias = nn.Parameter(torch.empty(out_features_local)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == FP8_DTYPE:  # --dtype fp8 (runtime/models/fp8.py)
            return fp8_linear(x, self, self.bias)
        return linear(x, self, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's input columns split: x arrives split the same way (the column-parallel
    layer's output), each rank computes a partial sum, and an all-reduce completes it. The bias is added once,
    after the reduction."""

    def __init__(self, in_features_local: int, out_features: int, bias: bool, parallel: ParallelContext):
        super().__init__()
        self.parallel = parallel
        self.weight = nn.Parameter(torch.empty(out_features, in_features_local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # --enable-lora (runtime/lora/manager.py): x -> this rank's partial adapter product [tokens, out] or
        # None. Added before the all-reduce, so the reduce that completes x W^T also sums the adapter's
        # partial products B (A_r x_r) (A split by input columns like W, B whole, scaling folded in once).
        self.lora_delta = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        matmul = (
            (lambda x_, b: fp8_linear(x_, self, b))
            if self.weight.dtype == FP8_DTYPE
            else (lambda x_, b: linear(x_, self, b))
        )
        single = self.parallel.size == 1
        y = matmul(x, self.bias if single else None)
        if self.lora_delta is not None:
            d = self.lora_delta(x)
            if d is not None:
                y = y + d.reshape(y.shape)
        if single:
            return y
        y = self.parallel.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [vocab_start, vocab_start + vocab_per_rank) on this rank (the last rank's tail rows past
    the real vocabulary are zero padding). A token outside the local range looks up zeros; the all-reduce
    then leaves exactly the owner's row. The same weight serves as the LM head when embeddings are tied."""

    def __init__(self, vocab_per_rank: int, vocab_start: int, vocab_size: int, hidden: int, parallel: ParallelContext):
        super().__init__()
        self.parallel = parallel
        self.vocab_start, self.vocab_per_rank, self.vocab_size = vocab_start, vocab_per_rank, vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_per_rank, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_per_rank)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0)
        return self.parallel.all_reduce(x)


def lm_head_logits(
    hidden: torch.Tensor, head: nn.Module, vocab_size: int, parallel: ParallelContext
) -> torch.Tensor | None:
    """Vocab-parallel LM head: each rank computes its slice of the logits, rank 0 gathers the full
    [rows, vocab] float32 logits (padding columns dropped); other ranks get None."""
    local = linear(hidden, head, None).float()  # [rows, vocab_per_rank]
    if parallel.size == 1:
        return local
    full = parallel.gather_last_dim(local)
    return None if full is None else full[:, :vocab_size]

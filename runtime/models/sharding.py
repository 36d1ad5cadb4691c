"""Which slice of each weight a tensor-parallel rank owns. Pure Python (no torch): the engine validates a
`tensor_parallel_size` against the model's shape with it before any worker process starts.

Query heads, the MLP's intermediate dimension and the vocabulary are split evenly (the vocabulary padded to a
multiple of t). A mixture-of-experts layer keeps every expert on every rank and splits each expert's
intermediate dimension the same way (its own width, moe_intermediate_size, may differ from the dense MLP's);
the router is replicated. KV heads follow the query heads: rank r keeps exactly the KV heads its query heads attend to.
With num_kv_heads divisible by t that is num_kv_heads / t each (the KV cache per rank shrinks by t); with
num_kv_heads < t and t divisible by num_kv_heads each rank keeps the one KV head its query heads share, and
that head is replicated on t / num_kv_heads ranks (the KV cache per rank is the one-KV-head share, not 1/t).
Any other split would give a rank query heads spread unevenly over its KV heads, which the attention
backends' GQA contract (query head h reads local KV head h // (heads / kv_heads)) cannot express; it is
rejected at startup with the sizes that would work.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.runtime.capacity import tp_shape_error


@dataclass(frozen=True)
class ShardSpec:
    """One rank's share of the model (all counts are per rank)."""

    rank: int
    size: int
    num_heads: int  # query heads on this rank
    q_head_start: int  # first global query head
    kv_head_ids: tuple[int, ...]  # global KV heads this rank keeps, in local order
    intermediate_size: int
    intermediate_start: int
    vocab_per_rank: int  # padded: ceil(vocab / t); the last rank's tail rows are padding
    vocab_start: int
    vocab_size: int  # the real (unpadded) vocabulary
    moe_intermediate_size: int = 0  # each expert's intermediate slice on this rank (0: no MoE layers)
    moe_intermediate_start: int = 0

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_head_ids)

    @property
    def vocab_end(self) -> int:
        """End of the real rows this rank holds (<= vocab_start + vocab_per_rank)."""
        return min(self.vocab_start + self.vocab_per_rank, self.vocab_size)


def split_widths_error(widths: dict[str, int], tp_size: int) -> str | None:
    """widths: config field -> FFN width that every rank gets 1/t of (see models.registry.split_widths)."""
    for name, width in widths.items():
        if width % tp_size:
            return f"{name}={width} is not divisible by tensor_parallel_size={tp_size}"
    return None


def shard_spec(
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    vocab_size: int,
    rank: int = 0,
    size: int = 1,
    moe_intermediate_size: int = 0,
) -> ShardSpec:
    error = tp_shape_error(num_heads, num_kv_heads, intermediate_size, size) or split_widths_error(
        {"moe_intermediate_size": moe_intermediate_size}, size
    )
    if error:
        raise ValueError(error)
    heads = num_heads // size
    q_start = rank * heads
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads % size == 0:
        per_rank = num_kv_heads // size
        kv_ids = tuple(range(rank * per_rank, (rank + 1) * per_rank))
    else:  # num_kv_heads < size: all of this rank's query heads share one KV head
        kv_ids = (q_start // group,)
    vocab_per_rank = -(-vocab_size // size)
    inter = intermediate_size // size
    moe_inter = moe_intermediate_size // size
    return ShardSpec(
        rank=rank,
        size=size,
        num_heads=heads,
        q_head_start=q_start,
        kv_head_ids=kv_ids,
        intermediate_size=inter,
        intermediate_start=rank * inter,
        vocab_per_rank=vocab_per_rank,
        vocab_start=rank * vocab_per_rank,
        vocab_size=vocab_size,
        moe_intermediate_size=moe_inter,
        moe_intermediate_start=rank * moe_inter,
    )

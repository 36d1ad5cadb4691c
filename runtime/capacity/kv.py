"""The KV cache: groups of layers sharing a block table (sliding-window models), one rank's layout (bytes per
token and per block), and blocks and tokens for a byte budget, with block 0 reserved as the null block (block
tables are padded with it; it never holds a token), so usable blocks = blocks - 1."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.runtime.capacity.dtypes import DTYPE_BYTES, kv_cache_dtype
from kvserve.runtime.capacity.shape import ModelShape
from kvserve.runtime.capacity.tensor_parallel import kv_heads_per_rank

NULL_BLOCKS = 1  # block 0: padding for block tables, never allocated to a request


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table (vLLM's KV cache group). sliding_window 0: full attention."""

    sliding_window: int
    layers: tuple[int, ...]  # model layer indices; a bucket's last group may hold fewer than layers_per_group


def layer_windows(layer_types, sliding_window: int) -> tuple[int, ...]:
    return tuple(sliding_window if t == "sliding_attention" and sliding_window else 0 for t in layer_types)


def kv_cache_groups(windows: tuple[int, ...]) -> tuple[KVCacheGroup, ...]:
    """Split layers into groups of equal size g, one group per block table, all drawing block ids from one
    pool (vLLM's hybrid KV cache manager). A block id then always buys g layers x block_size tokens,
    whichever group holds it, so the pool needs no per-group split. g = the smaller of the full and the
    sliding layer counts (Gemma 2: two groups of N/2; Gemma-3-1B: 4 full + 22 sliding -> 1 full group and 6
    sliding ones, 2 slots unused). Models without both kinds keep one group of every layer (no freeing)."""
    full = tuple(i for i, w in enumerate(windows) if not w)
    sliding: dict[int, list[int]] = {}
    for i, w in enumerate(windows):
        if w:
            sliding.setdefault(w, []).append(i)
    if not full or not sliding:
        return (KVCacheGroup(0, tuple(range(len(windows)))),)
    g = min(len(full), *(len(v) for v in sliding.values()))
    groups = [KVCacheGroup(0, full[i : i + g]) for i in range(0, len(full), g)]
    for w, layers in sliding.items():
        groups += [KVCacheGroup(w, tuple(layers[i : i + g])) for i in range(0, len(layers), g)]
    return tuple(groups)


def layer_group_index(groups: tuple[KVCacheGroup, ...]) -> dict[int, tuple[int, int]]:
    """layer -> (group, slot): the slot is which of the g per-slot KV tensors the layer uses."""
    return {layer: (gi, slot) for gi, g in enumerate(groups) for slot, layer in enumerate(g.layers)}


def shape_kv_cache_groups(shape: ModelShape) -> tuple[KVCacheGroup, ...]:
    """The grouping from the shape's counts (which layer is which does not change the sizes)."""
    num_sliding = shape.num_sliding_layers if shape.sliding_window else 0
    return kv_cache_groups((shape.sliding_window,) * num_sliding + (0,) * (shape.num_layers - num_sliding))


# -- KV layout and budgets --------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVLayout:
    """One rank's KV cache geometry. Every rank holds its KV heads' slice of the same tokens.
    group_windows: one entry per KV cache group (0 = full attention); empty = one group of every layer."""

    num_layers: int
    num_kv_heads: int  # whole model
    head_dim: int
    kv_dtype: str  # canonical (see kv_cache_dtype())
    block_size: int
    tensor_parallel_size: int = 1
    group_windows: tuple[int, ...] = ()
    layers_per_group: int = 0  # 0: num_layers

    @property
    def kv_heads_per_rank(self) -> int:
        return kv_heads_per_rank(self.num_kv_heads, self.tensor_parallel_size)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows) or 1

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer, whole model (all ranks together): the full-context charge."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.kv_dtype]

    @property
    def bytes_per_token_per_rank(self) -> int:
        return 2 * self.num_layers * self.kv_heads_per_rank * self.head_dim * DTYPE_BYTES[self.kv_dtype]

    @property
    def bytes_per_block(self) -> int:
        """One block id: block_size tokens of one group's layers (padding slots of a short group included)."""
        layers = self.layers_per_group or self.num_layers
        return self.block_size * 2 * layers * self.kv_heads_per_rank * self.head_dim * DTYPE_BYTES[self.kv_dtype]

    def blocks_for_budget(self, kv_cache_bytes: int) -> int:
        """Physical blocks a per-rank byte budget buys (the null block is one of them)."""
        return max(0, int(kv_cache_bytes) // self.bytes_per_block)

    def budget_for_blocks(self, num_blocks: int) -> int:
        return num_blocks * self.bytes_per_block

    def blocks_per_sequence(self, num_tokens: int, max_num_batched_tokens: int | None = None) -> int:
        """Blocks one sequence of num_tokens holds at its peak, over all groups. A sliding group holds the
        window's W - 1 earlier tokens plus one step's new ones (at most max_num_batched_tokens; None: the
        whole sequence in one step), +1 block because the window rarely starts on a block boundary
        (vLLM's SlidingWindowSpec charge); the KV manager frees the rest (core/kv_cache_manager.py)."""
        full = blocks_per_sequence(num_tokens, self.block_size)
        step = num_tokens if max_num_batched_tokens is None else max_num_batched_tokens
        total = 0
        for w in self.group_windows or (0,):
            total += (
                full if not w else min(full, blocks_per_sequence(min(w - 1 + step, num_tokens), self.block_size) + 1)
            )
        return total

    def usable_tokens(self, num_blocks: int) -> int:
        """Tokens of context the cache holds with every group holding all of them (the full-context view:
        kvTokens and the kv_capacity gauge); sliding groups make sequences cheaper than that (max_concurrency)."""
        return usable_tokens(num_blocks, self.block_size, self.num_groups)

    def max_concurrency(self, num_blocks: int, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
        return usable_blocks(num_blocks) // self.blocks_per_sequence(max_model_len, max_num_batched_tokens)

    def longest_sequence(self, num_blocks: int, limit: int, max_num_batched_tokens: int | None = None) -> int:
        """The longest single sequence (<= limit tokens) that fits in num_blocks."""
        usable = usable_blocks(num_blocks)
        lo, hi = 0, limit
        while lo < hi:  # blocks_per_sequence grows with the length
            mid = (lo + hi + 1) // 2
            if self.blocks_per_sequence(mid, max_num_batched_tokens) <= usable:
                lo = mid
            else:
                hi = mid - 1
        return lo


def kv_layout(shape: ModelShape, dtype: str, kv_cache_dtype_name: str, block_size: int, tp_size: int) -> KVLayout:
    groups = shape_kv_cache_groups(shape)
    windows = tuple(g.sliding_window for g in groups) if len(groups) > 1 else ()
    return KVLayout(
        shape.num_layers,
        shape.num_kv_heads,
        shape.head_dim,
        kv_cache_dtype(dtype, kv_cache_dtype_name),
        block_size,
        tp_size,
        group_windows=windows,
        layers_per_group=len(groups[0].layers) if windows else 0,
    )


def usable_blocks(num_blocks: int) -> int:
    return max(0, num_blocks - NULL_BLOCKS)


def usable_tokens(num_blocks: int, block_size: int, num_groups: int = 1) -> int:
    """Tokens the KV cache can hold: the `kvserve:kv_capacity_tokens` gauge and the plan's kvTokens. With
    several KV cache groups (sliding-window models) every group holds each token of a full-context sequence."""
    return usable_blocks(num_blocks) // num_groups * block_size


def blocks_per_sequence(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def max_concurrency(num_blocks: int, max_model_len: int, block_size: int) -> int:
    """Sequences of max_model_len tokens that fit at once (single-group layouts; see KVLayout.max_concurrency)."""
    return usable_blocks(num_blocks) // blocks_per_sequence(max_model_len, block_size)


def one_sequence_error(
    num_blocks: int, max_model_len: int, layout: KVLayout, source: str, max_num_batched_tokens: int | None = None
) -> str | None:
    """The refusal both sides give when one max_model_len sequence cannot fit (None when it fits).
    `source` names the setting that decided the budget (kv_cache_bytes, num_kv_blocks, ...)."""
    usable = usable_blocks(num_blocks)
    needed = layout.blocks_per_sequence(max_model_len, max_num_batched_tokens)
    if usable >= needed:
        return None
    longest = layout.longest_sequence(num_blocks, max_model_len, max_num_batched_tokens)
    held = (
        f"{usable * layout.block_size} tokens"
        if layout.num_groups == 1
        else f"shared by {layout.num_groups} KV cache groups"
    )
    return (
        f"{source}: the KV cache holds {usable} usable blocks of {layout.block_size} tokens "
        f"({held}) per rank, but one max_model_len={max_model_len} sequence needs "
        f"{needed} blocks ({layout.budget_for_blocks(needed + NULL_BLOCKS)} bytes with the null block); "
        f"raise the KV budget or set max_model_len <= {longest}"
    )

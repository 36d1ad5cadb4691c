"""Block arithmetic of a sliding-window KV cache group. Pure Python (no torch).

A sliding layer with window W lets the query at position p see keys p - W < k <= p (transformers' rule),
so before a step that starts at position c, the keys of positions < c - W + 1 are never read again: the
KV manager swaps the whole blocks among them for the null block and frees them (vLLM's
SlidingWindowManager.remove_skipped_blocks). A prefix-cache hit of L blocks needs only the blocks that the
next token's window reaches: the last cdiv(W - 1, block_size) before L.
"""

from __future__ import annotations

from collections.abc import Callable


def num_skipped_blocks(num_computed_tokens: int, window: int, block_size: int) -> int:
    """Leading blocks that no query from position num_computed_tokens onward reads (0 for full attention)."""
    if not window:
        return 0
    return max(0, num_computed_tokens - window + 1) // block_size


def num_window_blocks(window: int, block_size: int) -> int:
    """Blocks before a block-aligned position that its query's window reaches."""
    return -(-(window - 1) // block_size)


def longest_hit(is_cached: Callable[[int], bool], max_blocks: int, window: int, block_size: int) -> int:
    """The longest prefix-hit length L <= max_blocks (in blocks) this group can serve: full attention needs
    blocks [0, L) cached; a sliding window only [L - need, L), scanned right to left (vLLM's
    find_longest_cache_hit). Returns L; the caller fills blocks before the window with the null block."""
    if not window:
        n = 0
        while n < max_blocks and is_cached(n):
            n += 1
        return n
    need = num_window_blocks(window, block_size)
    if need == 0:  # a window of 1: the query only sees itself
        return max_blocks
    run = 0
    for i in range(max_blocks - 1, -1, -1):
        if not is_cached(i):
            run = 0
            continue
        run += 1
        if run >= need:
            return i + need
    return run  # blocks [0, run) are cached and the window reaches the start

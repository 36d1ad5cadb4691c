"""The runner's persistent block tables against a plain dict of lists, under random diffs from the
scheduler's SentBlockTables (appends, in-place replacements, resets, finishes, growth past the initial rows)."""

from __future__ import annotations

import random

import pytest

from kvserve.runtime.core.block_table_diff import BlockTableDiff, SentBlockTables
from kvserve.runtime.executor.block_tables import BlockTables


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id


@pytest.mark.parametrize("seed", range(5))
def test_rows_follow_random_diffs(seed):
    rng = random.Random(seed)
    pool = [Block(i) for i in range(200)]
    max_blocks = 12
    tables, sent, truth = BlockTables(max_blocks, num_rows=2), SentBlockTables(), {}
    live: dict[str, list[Block]] = {}
    for step in range(300):
        rid = f"r{rng.randrange(10)}"
        action = rng.random()
        if rid in live and action < 0.1:  # finished
            del live[rid]
            sent.forget(rid)
            tables.remove(rid)
            truth.pop(rid)
            continue
        blocks = live.setdefault(rid, [])
        if action < 0.2:  # preempted and back with other blocks
            sent.forget(rid)
            blocks[:] = rng.sample(pool, rng.randrange(1, max_blocks))
        elif action < 0.35 and blocks:  # copy-on-write / sliding-window null block: replaced in place
            blocks[rng.randrange(len(blocks))] = rng.choice(pool)
        elif len(blocks) < max_blocks:
            blocks.extend(rng.sample(pool, rng.randrange(0, min(3, max_blocks - len(blocks)) + 1)))
        diff = sent.diff(rid, blocks)
        tables.apply(rid, diff)
        truth[rid] = diff.apply(truth.get(rid, []))
        for other, ids in truth.items():
            assert tables.block_ids(other) == ids == [b.block_id for b in live[other]], f"step {step}"
            row = tables.row_of[other]
            assert not tables.table[row, len(ids) :].any()  # beyond the table: the null block
    assert tables.table.shape[0] >= len(live)


def test_patch_for_an_unknown_table_is_refused():
    with pytest.raises(RuntimeError, match="out of step"):
        BlockTables(4).apply("x", BlockTableDiff([3]))

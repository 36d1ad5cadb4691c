"""The runner's persistent block tables: one row per live request in a preallocated int32 array, patched
from the scheduler's per-step BlockTableDiffs (core/block_table_diff.py) instead of rebuilt from full lists.

Rows live in numpy (scalar writes cost ~0.1 us there, ~2 us on a torch tensor); a step gathers its rows with
one fancy index. Rows are kept while a request is preempted (its table is reset when it comes back) and
freed when it finishes; the array grows by doubling, so a long queue of preempted requests only costs memory.
"""

from __future__ import annotations

import numpy as np

from kvserve.runtime.core.block_table_diff import BlockTableDiff


class BlockTables:
    def __init__(self, max_blocks_per_request: int, num_rows: int = 64):
        self.table = np.zeros((num_rows, max_blocks_per_request), dtype=np.int32)  # unused entries: null block 0
        self.num_blocks = np.zeros(num_rows, dtype=np.int64)  # table length per row
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))  # pop() hands out the lowest row

    def apply(self, req_id: str, diff: BlockTableDiff) -> int:
        """Patch req_id's row with one step's diff; returns the row."""
        row = self.row_of.get(req_id)
        if row is not None and not diff.reset and not diff.replaced:  # a decode step: unchanged or appended
            if diff.appended:
                n, k = int(self.num_blocks[row]), len(diff.appended)
                self.table[row, n : n + k] = diff.appended
                self.num_blocks[row] = n + k
            return row
        if row is None:
            if not diff.reset:
                raise RuntimeError(
                    f"block table diff for {req_id!r}, whose table this runner does not hold "
                    f"(scheduler and runner out of step)"
                )
            row = self._new_row(req_id)
        n = int(self.num_blocks[row])
        if diff.reset:
            k = len(diff.appended)
            self.table[row, :k] = diff.appended
            if n > k:
                self.table[row, k:n] = 0
            self.num_blocks[row] = k
            return row
        table = self.table[row]
        for index, block_id in diff.replaced:
            table[index] = block_id
        k = len(diff.appended)
        table[n : n + k] = diff.appended
        self.num_blocks[row] = n + k
        return row

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        self.table[row, : int(self.num_blocks[row])] = 0
        self.num_blocks[row] = 0
        self._free_rows.append(row)

    def block_ids(self, req_id: str) -> list[int]:
        row = self.row_of[req_id]
        return self.table[row, : int(self.num_blocks[row])].tolist()

    def _new_row(self, req_id: str) -> int:
        if not self._free_rows:
            old = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        row = self._free_rows.pop()
        self.row_of[req_id] = row
        return row

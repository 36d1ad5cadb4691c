"""What the model runner already holds of each request's block table, so a step sends only the change.

The runner keeps every request's block table across steps (persistent batch); each step the scheduler sends,
per scheduled request, a `BlockTableDiff`: usually a few appended block ids, sometimes entries overwritten in
place (a sliding-window layer group dropping blocks that left its window for the null block), and a full table when
the runner's copy cannot be patched (first schedule,
resume after preemption or swap-in). Pure Python (no torch).

Why blocks are compared by object identity: a block table is a list of KVCacheBlock objects, each owning a
fixed block id, mutated in place by the KV-cache manager; `list == list` then runs in C and stops at the
first differing object, so an unchanged prefix of any length costs nanoseconds per entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class BlockTableDiff:
    """Apply to the runner's copy of one table: if `reset`, the table becomes `appended`; otherwise first
    `table[i] = block_id` for each `replaced` pair, then `table += appended`."""

    appended: list[int] = field(default_factory=list)
    replaced: list[tuple[int, int]] = field(default_factory=list)  # (index, block id)
    reset: bool = False

    def apply(self, table: list[int]) -> list[int]:
        """The patched table (in place unless reset). The runner-side reference of the protocol."""
        if self.reset:
            return list(self.appended)
        for index, block_id in self.replaced:
            table[index] = block_id
        table.extend(self.appended)
        return table


NO_CHANGE = BlockTableDiff()  # shared: never mutated (apply reads it only)


class SentBlockTables:
    """The scheduler's record of each request's table as the runner last received it. Tables are lists of
    block objects (a `block_id` attribute; compared by identity), or of plain block ids with `ids=True`
    (KV cache groups 1.., which the KV-cache manager hands out as ids)."""

    def __init__(self, ids: bool = False) -> None:
        self._sent: dict[str, list] = {}  # request id -> blocks as last sent
        self._ids = ids

    def diff(self, request_id: str, blocks: Sequence) -> BlockTableDiff:
        """Diff from what was sent for `request_id` to `blocks`, recording `blocks` as sent."""
        sent = self._sent.get(request_id)
        if sent is None:
            self._sent[request_id] = list(blocks)
            return BlockTableDiff(self._block_ids(blocks), reset=True)
        num_sent, num_blocks = len(sent), len(blocks)
        if num_blocks == num_sent and blocks == sent:  # most decode steps: the table did not change
            return NO_CHANGE
        if num_blocks > num_sent and blocks[:num_sent] == sent:  # a block was appended
            new = blocks[num_sent:]
            sent.extend(new)
            return BlockTableDiff(self._block_ids(new))
        if num_blocks < num_sent:  # shrank: never happens while a request keeps its blocks; resend
            self._sent[request_id] = list(blocks)
            return BlockTableDiff(self._block_ids(blocks), reset=True)
        changed = [i for i in range(num_sent) if blocks[i] != sent[i]]  # objects: identity; ids: value
        replaced = list(zip(changed, self._block_ids([blocks[i] for i in changed])))
        self._sent[request_id] = list(blocks)
        return BlockTableDiff(self._block_ids(blocks[num_sent:]), replaced)

    def _block_ids(self, blocks: Sequence) -> list[int]:
        return list(blocks) if self._ids else [b.block_id for b in blocks]

    def forget(self, request_id: str) -> None:
        """The runner will not hold this table any more (finished), or must get it whole next time
        (preempted: it comes back with new blocks)."""
        self._sent.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._sent

"""KV cache groups on the runner side (sliding-window models; see runtime/capacity.py kv_cache_groups).

The KV tensor holds `layers_per_group` slots instead of one per layer: layer i uses the slot it has in its
group, and a block id (owned by one group at a time) addresses the same rows in every slot. Each group has
its own block table, so each gets its own slot mapping and block tables; the rest of the step's metadata
(query/context lengths) is shared.
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.runtime.core.outputs import ScheduledRequest
from kvserve.runtime.executor.block_tables import BlockTables
from kvserve.runtime.models.attention import AttentionMetadata


def layer_slots(model, num_layers: int) -> list[int]:
    """The KV tensor slot of each layer: its index in its group, or the layer index for single-group models."""
    groups = getattr(model, "layer_groups", None)
    return [groups[i][1] for i in range(num_layers)] if groups else list(range(num_layers))


def group_metadata(
    runner, scheduled: list[ScheduledRequest], meta: AttentionMetadata, query_lens: np.ndarray, positions: np.ndarray
) -> list[AttentionMetadata]:
    """[group 0's meta (built by the runner), then one per group 1..]. Each group's persistent block tables
    (runner.group_block_tables) are patched with this step's diffs first; query_lens [num_seqs] and
    positions [num_tokens] are the step's, shared by every group."""
    metas = [meta]
    bs = runner.block_size
    num_groups = len(scheduled[0].group_block_tables)
    while len(runner.group_block_tables) < num_groups:
        runner.group_block_tables.append(
            BlockTables(runner.block_tables.table.shape[1], num_rows=runner.block_tables.table.shape[0])
        )
    seq_lens = np.array(meta.seq_lens_list)
    for g in range(num_groups):
        tables = runner.group_block_tables[g]
        rows = np.array([tables.apply(s.req_id, s.group_block_tables[g]) for s in scheduled])
        token_rows = np.repeat(rows, query_lens)
        slots = tables.table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        width = int(tables.num_blocks[rows].max())
        metas.append(
            runner._metadata(
                query_lens, seq_lens, tables.table[rows, :width], torch.from_numpy(slots).to(runner.device)
            )
        )
    return metas

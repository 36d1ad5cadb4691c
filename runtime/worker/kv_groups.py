"""KV cache groups on the runner side (sliding-window models; see runtime/capacity.py kv_cache_groups).

The KV tensor holds `layers_per_group` slots instead of one per layer: layer i uses the slot it has in its
group, and a block id (owned by one group at a time) addresses the same rows in every slot. Each group has
its own block table, so each gets its own slot mapping and block tables; the rest of the step's metadata
(query/context lengths) is shared.
"""
from __future__ import annotations

import torch

from kvserve.runtime.core.outputs import ScheduledRequest
from kvserve.runtime.models.attention import AttentionMetadata


def layer_slots(model, num_layers: int) -> list[int]:
    """The KV tensor slot of each layer: its index in its group, or the layer index for single-group models."""
    groups = getattr(model, "layer_groups", None)
    return [groups[i][1] for i in range(num_layers)] if groups else list(range(num_layers))


def group_metadata(runner, scheduled: list[ScheduledRequest], meta: AttentionMetadata) -> list[AttentionMetadata]:
    """[group 0's meta (built by the runner from block_ids), then one per group 1..]."""
    metas = [meta]
    bs = runner.block_size
    for g in range(len(scheduled[0].group_block_ids)):
        tables = [s.group_block_ids[g] for s in scheduled]
        slots = [table[p // bs] * bs + p % bs for s, table in zip(scheduled, tables)
                 for p in range(s.start_position, s.start_position + len(s.token_ids))]
        metas.append(runner._metadata(meta.query_lens_list, meta.seq_lens_list, tables,
                                      torch.tensor(slots, dtype=torch.long, device=runner.device)))
    return metas

"""The KV connector's worker half for the host KV tier (--kv-offloading-size; the scheduler half is
core/tier_connector.py): the runner copies the step's loads host -> device before the forward and its saves
device -> host after it, through the same copy routine and host tensor as swap preemption (ModelRunner._swap:
every layer of the listed blocks, pinned host memory on CUDA).

Each rank runs this on its own SchedulerOutput copy (the multiproc executor fans the step out), so under
tensor parallelism every rank moves its own KV heads' shard, and under pipeline parallelism its own layers.
The copies are synchronous: a step's loads and saves are done when execute returns, so the output names
them all as finished (a later asynchronous version would report them in a later step instead). The disk
tier (executor/disk_store.py) reads its fetches in the step and writes from a background thread.
"""

from __future__ import annotations

from collections.abc import Callable

from kvserve.runtime.core.outputs import ModelRunnerOutput, SchedulerOutput

# ModelRunner._swap(device_to_host, host_to_device), each a list of (from block, to block)
CopyBlocks = Callable[[list[tuple[int, int]], list[tuple[int, int]]], None]


def before_forward(copy_blocks: CopyBlocks, sched: SchedulerOutput, disk=None, host_kv=None) -> dict[str, list[int]]:
    """Disk fetches into host slots (the disk tier: disk=DiskStore), swap-outs (a block they free may receive
    a load in this step), then swap-ins and loads. Returns the fetches' failed positions per request."""
    failed: dict[str, list[int]] = {}
    for rid, t in sched.kv_connector.fetch.items():
        bad = [
            i
            for i, (slot, h) in enumerate(zip(t.host_block_ids, t.block_hashes))
            if not disk.read_into(h, host_kv[:, :, slot])
        ]
        if bad:
            failed[rid] = bad
    swap_in = sched.swap_in
    if sched.kv_connector.load:
        swap_in = swap_in + [
            (h, d) for t in sched.kv_connector.load.values() for d, h in zip(t.block_ids, t.host_block_ids)
        ]
    if sched.swap_out or swap_in:
        copy_blocks(sched.swap_out, swap_in)
    return failed


def after_forward(
    copy_blocks: CopyBlocks,
    sched: SchedulerOutput,
    out: ModelRunnerOutput,
    failed: dict[str, list[int]],
    disk=None,
    host_kv=None,
) -> None:
    """Saves of blocks this step filled (and, with the disk tier, their copies handed to its writer thread);
    then report the step's transfers done."""
    conn = sched.kv_connector
    if conn.save:
        copy_blocks([(d, h) for t in conn.save.values() for d, h in zip(t.block_ids, t.host_block_ids)], [])
        out.finished_sending = set(conn.save)
        if disk is not None:
            for t in conn.save.values():
                for slot, h in zip(t.host_block_ids, t.block_hashes):
                    if h:  # a copy: the slot may be reused before the writer gets to it
                        disk.write_async(h, host_kv[:, :, slot].clone())
    if disk is not None:
        for h in conn.drop:
            disk.delete_async(h)
    if conn.load or conn.fetch:
        out.finished_receiving = set(conn.load) | set(conn.fetch)
        out.failed_receiving = failed

"""The KV connector's worker half for the host KV tier (--kv-offloading-size; the scheduler half is
core/tier_connector.py): the runner copies the step's loads host -> device before the forward and its saves
device -> host after it, through the same copy routine and host tensor as swap preemption (ModelRunner._swap:
every layer of the listed blocks, pinned host memory on CUDA).

Saves run off the critical path, on one background thread: execute returns as soon as the forward is done,
and the copies overlap the engine's output handling and its next schedule. Every later use of the blocks they
touch -- a swap or load into the same host slot, a forward that overwrites the device block once it is
evicted -- happens in a later step, and the next step waits for the saves before it does anything (its first
act), so the output reports the saves as finished with their own step: in the order that matters, they are.

Each rank runs this on its own SchedulerOutput copy (the multiproc executor fans the step out), so under
tensor parallelism every rank moves its own KV heads' shard, and under pipeline parallelism its own layers.
The disk tier (executor/disk_store.py) reads its fetches in the step and writes from its own writer thread.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from kvserve.runtime.core.outputs import ModelRunnerOutput, SchedulerOutput

# ModelRunner._swap(device_to_host, host_to_device), each a list of (from block, to block)
CopyBlocks = Callable[[list[tuple[int, int]], list[tuple[int, int]]], None]
# With more than one rank: this rank's per-block read results in, every rank's AND out (a collective every rank
# calls in the same steps: they all run the same fetches), so a block one rank failed to read fails on all.
AgreeOnReads = Callable[[list[bool]], list[bool]]


class HostTierWorker:
    def __init__(self, copy_blocks: CopyBlocks, host_kv, disk=None, agree: AgreeOnReads | None = None):
        self.copy_blocks = copy_blocks
        self.host_kv = host_kv
        self.disk = disk  # DiskStore or None
        self.agree = agree  # None: one rank
        self._saver: ThreadPoolExecutor | None = None  # started on the first save
        self._saving: Future | None = None

    def wait_for_saves(self) -> None:
        """The previous step's saves are done (raises what they raised)."""
        saving, self._saving = self._saving, None
        if saving is not None:
            saving.result()

    def flush(self) -> None:
        """Every save done and, with the disk tier, every file written (tests, shutdown)."""
        self.wait_for_saves()
        if self.disk is not None:
            self.disk.flush()

    def before_forward(self, sched: SchedulerOutput) -> dict[str, list[int]]:
        """The previous step's saves first; disk fetches into host slots; swap-outs (a block they free may
        receive a load in this step), then swap-ins and loads. Returns the fetches' failed positions."""
        self.wait_for_saves()
        conn = sched.kv_connector
        failed: dict[str, list[int]] = {}
        if conn.fetch:
            # Every rank reads its own shard of each block; only the sampling rank's output reaches the
            # scheduler, so the ranks agree first: a block is fetched only if every rank read its shard.
            reads = [
                self.disk.read_into(h, self.host_kv[:, :, slot])
                for t in conn.fetch.values()
                for slot, h in zip(t.host_block_ids, t.block_hashes)
            ]
            if self.agree is not None:
                reads = self.agree(reads)
            at = 0
            for rid, t in conn.fetch.items():
                bad = [i for i in range(len(t.host_block_ids)) if not reads[at + i]]
                at += len(t.host_block_ids)
                if bad:
                    failed[rid] = bad
        swap_in = sched.swap_in
        if conn.load:
            swap_in = swap_in + [(h, d) for t in conn.load.values() for d, h in zip(t.block_ids, t.host_block_ids)]
        if sched.swap_out or swap_in:
            self.copy_blocks(sched.swap_out, swap_in)
        return failed

    def after_forward(self, sched: SchedulerOutput, out: ModelRunnerOutput, failed: dict[str, list[int]]) -> None:
        """Start the saves of the blocks this step filled (and their disk writes) on the saver thread, queue
        the disk tier's deletions; report the step's transfers."""
        conn = sched.kv_connector
        if conn.save:
            if self._saver is None:
                self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvserve-kv-save")
            self._saving = self._saver.submit(self._save, list(conn.save.values()))
            out.finished_sending = set(conn.save)
        if self.disk is not None:
            for h in conn.drop:
                self.disk.delete_async(h)
        if conn.load or conn.fetch:
            out.finished_receiving = set(conn.load) | set(conn.fetch)
            out.failed_receiving = failed

    def _save(self, transfers: list) -> None:
        self.copy_blocks([(d, h) for t in transfers for d, h in zip(t.block_ids, t.host_block_ids)], [])
        if self.disk is not None:
            for t in transfers:
                for slot, h in zip(t.host_block_ids, t.block_hashes):
                    if h:  # a copy: the slot may be reused before the writer gets to it
                        self.disk.write_async(h, self.host_kv[:, :, slot].clone())

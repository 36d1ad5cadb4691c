"""The host KV tier's scheduler half (--kv-offloading-size): the KV connector seam's scheduler side for the
one connector kvserve has, vLLM's OffloadingConnector semantics on our host pool (core/host_pool.py). Pure
Python.

- Lookup: on a device prefix-cache miss the scheduler asks how many further full blocks of the request's
  prefix the tier holds (same chained hashes as the device cache: the LoRA adapter is in their root). It
  allocates device blocks for them and the loads are recorded here; the runner copies host -> device before
  the step's forward, so the loaded tokens count as computed in the very step that loads them.
- Save on store (vLLM offloads on store, not on eviction): a block of group 0 that becomes full and cached
  on the device is recorded for a save (device -> host after the step's forward), unless the tier already
  holds that hash. So by the time the device pool evicts it, the host has it, and eviction costs nothing.
- Completion: a step's output names the requests whose loads/saves ran (ModelRunnerOutput.finished_receiving
  / finished_sending); only then do saved entries become visible and loaded slots unpinned. A step whose
  output never came (it failed) is aborted: its saves are dropped and the device blocks it was loading lose
  their prefix-cache entry (their KV may never have arrived).
"""

from __future__ import annotations

from collections import deque

from kvserve.runtime.core.block_pool import BlockPool, KVCacheBlock
from kvserve.runtime.core.host_pool import HostBlockPool
from kvserve.runtime.core.outputs import KVConnectorStep, KVTransfer
from kvserve.runtime.request import Request


class HostTierConnector:
    def __init__(self, host: HostBlockPool, device: BlockPool, block_size: int):
        self.host = host
        self.device = device
        self.block_size = block_size
        self._step = KVConnectorStep()
        # Steps handed out and not reported done, oldest first, with the device blocks (and their hashes)
        # each one loads: what an aborted step must uncache.
        self._issued: deque[tuple[KVConnectorStep, list[tuple[KVCacheBlock, bytes]]]] = deque()
        self._loading: list[tuple[KVCacheBlock, bytes]] = []
        self._matched: dict[str, list[int]] = {}  # req id -> pinned slots of a match not yet recorded

    # -- scheduling ------------------------------------------------------------------------------------
    def match(self, request: Request, num_device_blocks: int) -> int:
        """Full blocks after the device hit that the tier holds (capped like a device hit: the last token is
        always computed, for its logits). They are pinned at once -- the saves that allocating for them
        records must not evict them -- until record_load takes them or unmatch gives them back."""
        bs = self.block_size
        end = (request.num_tokens - 1) // bs
        if num_device_blocks >= end:
            return 0
        ids = request.all_token_ids
        hashes = request.block_hashes[num_device_blocks:end]
        tokens = [tuple(ids[i * bs : (i + 1) * bs]) for i in range(num_device_blocks, end)]
        num = self.host.lookup(hashes, tokens)
        if num:
            self._matched[request.request_id] = self.host.pin_for_load(hashes[:num])
        return num

    def unmatch(self, request: Request) -> None:
        """The request could not be admitted after all: its matched entries are free to go again."""
        slots = self._matched.pop(request.request_id, None)
        if slots:
            self.host.unpin(slots)

    def record_load(self, request: Request, blocks: list[KVCacheBlock], first: int) -> None:
        """The request's blocks[first : first + matched] receive the tier's copies before this step's forward."""
        slots = self._matched.pop(request.request_id)
        self.host.num_loaded_blocks += len(slots)
        targets = blocks[first : first + len(slots)]
        self._step.load[request.request_id] = KVTransfer(
            [b.block_id for b in targets], len(slots) * self.block_size, host_block_ids=slots
        )
        self._loading += zip(targets, request.block_hashes[first : first + len(slots)])

    def record_saves(self, request: Request, blocks: list[KVCacheBlock], start: int, end: int) -> None:
        """Blocks[start:end] of group 0 just became full and cached: save the ones the tier lacks."""
        bs, hashes, ids = self.block_size, request.block_hashes, request.all_token_ids
        transfer = None
        for i in range(start, end):
            h = hashes[i]
            if self.host.contains(h):
                continue
            slot = self.host.reserve_for_save(h, tuple(ids[i * bs : (i + 1) * bs]), hashes[i - 1] if i else None)
            if slot is None:  # the host pool is all swapped requests and in-flight copies: skip
                return
            if transfer is None:
                transfer = self._step.save.get(request.request_id)
                if transfer is None:
                    transfer = self._step.save[request.request_id] = KVTransfer([], 0, host_block_ids=[])
            transfer.block_ids.append(blocks[i].block_id)
            transfer.host_block_ids.append(slot)
            transfer.num_tokens += bs

    def take_step(self) -> KVConnectorStep:
        step, self._step = self._step, KVConnectorStep()
        loading, self._loading = self._loading, []
        if not step.is_empty:
            self._issued.append((step, loading))
        return step

    # -- completion ------------------------------------------------------------------------------------
    def step_done(self, step: KVConnectorStep, finished_sending: set[str], finished_receiving: set[str]) -> None:
        if step.is_empty:
            return
        while self._issued and self._issued[0][0] is not step:  # older steps whose output never came
            self._abort(*self._issued.popleft())
        if not self._issued:
            return
        self._issued.popleft()
        for transfer in step.load.values():
            self.host.unpin(transfer.host_block_ids)
        for rid, transfer in step.save.items():
            if rid in finished_sending:
                self.host.commit(transfer.host_block_ids)
            else:
                self.host.abort(transfer.host_block_ids)

    def abort_outstanding(self) -> None:
        """Without micro-batches every step's output is applied before the next schedule: a step still issued
        then has failed."""
        while self._issued:
            self._abort(*self._issued.popleft())

    def _abort(self, step: KVConnectorStep, loading: list[tuple[KVCacheBlock, bytes]]) -> None:
        for transfer in step.load.values():
            self.host.unpin(transfer.host_block_ids)
        for transfer in step.save.values():
            self.host.abort(transfer.host_block_ids)
        for block, h in loading:
            if block.block_hash == h:
                self.device.uncache_block(block)

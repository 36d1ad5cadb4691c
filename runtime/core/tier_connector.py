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
- The disk tier below (core/disk_index.py, optional): every save to the host is written to disk too; a
  prefix found on disk past the host's run is fetched into host slots first (the request waits one step),
  then loaded as a host hit. A block that fails to arrive is simply not in the host tier: recomputed.
"""

from __future__ import annotations

from collections import deque

from kvserve.runtime.core.block_pool import BlockPool, KVCacheBlock
from kvserve.runtime.core.disk_index import DiskIndex
from kvserve.runtime.core.host_pool import HostBlockPool
from kvserve.runtime.core.outputs import KVConnectorStep, KVTransfer
from kvserve.runtime.request import Request


class HostTierConnector:
    def __init__(self, host: HostBlockPool, device: BlockPool, block_size: int, disk: DiskIndex | None = None):
        self.host = host
        self.disk = disk
        self._fetching: set[str] = set()  # requests waiting for a fetch from disk into the host tier
        self._fetched: set[str] = set()  # requests whose fetch is done: their next match fetches nothing
        self.device = device
        self.block_size = block_size
        self._step = KVConnectorStep()
        # Steps handed out and not reported done, oldest first, with the device blocks (and their hashes)
        # each one loads: what an aborted step must uncache.
        self._issued: deque[tuple[KVConnectorStep, list[tuple[KVCacheBlock, bytes]]]] = deque()
        self._loading: list[tuple[KVCacheBlock, bytes]] = []
        self._matched: dict[str, list[int]] = {}  # req id -> pinned slots of a match not yet recorded

    # -- scheduling ------------------------------------------------------------------------------------
    def match(self, request: Request, num_device_blocks: int) -> int | None:
        """Full blocks after the device hit that the tier holds (capped like a device hit: the last token is
        always computed, for its logits); None: the disk tier is fetching more of the prefix into the host
        tier, ask again next step. They are pinned at once -- the saves that allocating for them
        records must not evict them -- until record_load takes them or unmatch gives them back."""
        bs = self.block_size
        end = (request.num_tokens - 1) // bs
        if num_device_blocks >= end:
            return 0
        ids = request.all_token_ids
        hashes = request.block_hashes[num_device_blocks:end]
        tokens = [tuple(ids[i * bs : (i + 1) * bs]) for i in range(num_device_blocks, end)]
        num = self.host.lookup(hashes, tokens)
        if self.disk is not None and num < len(hashes):
            # One fetch per admission: a prefix longer than the host tier would otherwise evict its own
            # fetched blocks fetching the rest, forever. The host run is promoted first for the same reason.
            if request.request_id in self._fetched:
                self._fetched.discard(request.request_id)
            elif self._fetch(request, num_device_blocks + num, end, hashes[:num]):
                return None
        if num:
            self._matched[request.request_id] = self.host.pin_for_load(hashes[:num])
        return num

    def _fetch(self, request: Request, first: int, end: int, host_run: list[bytes]) -> bool:
        """Blocks first.. of the prefix that the disk holds: record their fetch into host slots; True when the
        request must wait for it (a step)."""
        rid = request.request_id
        if rid in self._fetching:
            return True
        bs, hashes, ids = self.block_size, request.block_hashes, request.all_token_ids
        num = self.disk.lookup(hashes[first:end])
        if num:
            self.host.touch(host_run)
        transfer = KVTransfer([], 0, host_block_ids=[], block_hashes=[])
        for i in range(first, first + num):
            slot = self.host.reserve_for_save(
                hashes[i], tuple(ids[i * bs : (i + 1) * bs]), hashes[i - 1] if i else None, request.lora_name
            )
            if slot is None:
                break
            transfer.host_block_ids.append(slot)
            transfer.block_hashes.append(hashes[i])
            transfer.num_tokens += bs
        if not transfer.host_block_ids:
            return False
        self.disk.touch(transfer.block_hashes)
        self._step.fetch[rid] = transfer
        self._fetching.add(rid)
        return True

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
            slot = self.host.reserve_for_save(
                h, tuple(ids[i * bs : (i + 1) * bs]), hashes[i - 1] if i else None, request.lora_name
            )
            if slot is None:  # the host pool is all swapped requests and in-flight copies: skip
                return
            if transfer is None:
                transfer = self._step.save.get(request.request_id)
                if transfer is None:
                    transfer = self._step.save[request.request_id] = KVTransfer([], 0, host_block_ids=[])
            transfer.block_ids.append(blocks[i].block_id)
            transfer.host_block_ids.append(slot)
            transfer.num_tokens += bs
            if self.disk is not None:  # write through to disk, unless it has the block already
                transfer.block_hashes.append(b"" if h in self.disk else h)
                if h not in self.disk:
                    self.disk.add(h, ids[i * bs : (i + 1) * bs], hashes[i - 1] if i else None, request.lora_name)

    def take_step(self) -> KVConnectorStep:
        step, self._step = self._step, KVConnectorStep()
        if self.disk is not None:
            step.drop = self.disk.take_deletions()
        loading, self._loading = self._loading, []
        if not step.is_empty:
            self._issued.append((step, loading))
        return step

    # -- completion ------------------------------------------------------------------------------------
    def step_done(
        self,
        step: KVConnectorStep,
        finished_sending: set[str],
        finished_receiving: set[str],
        failed_receiving: dict[str, list[int]],
    ) -> None:
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
        for rid, transfer in step.fetch.items():
            self._fetching.discard(rid)
            self._fetched.add(rid)
            failed = (
                set(failed_receiving.get(rid, ()))
                if rid in finished_receiving
                else set(range(len(transfer.host_block_ids)))
            )
            slots = transfer.host_block_ids
            self.host.commit([s for i, s in enumerate(slots) if i not in failed])
            self.disk.num_hit_blocks += len(slots) - len(failed)
            self.host.abort([s for i, s in enumerate(slots) if i in failed])
            self.disk.discard([transfer.block_hashes[i] for i in sorted(failed)])

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
        for rid, transfer in step.fetch.items():
            self._fetching.discard(rid)
            self.host.abort(transfer.host_block_ids)
        for block, h in loading:
            if block.block_hash == h:
                self.device.uncache_block(block)

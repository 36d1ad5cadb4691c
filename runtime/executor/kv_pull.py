"""P/D disaggregation, the runner's half (vLLM's NixlConnector worker side; the scheduler's half is
core/pd_connector.py): the KV tensor registered with a NIXL agent; on a prefill engine the side channel that
hands out its metadata, and the notifications that end leases; on a decode engine the pulls.

A pull (KVConnectorStep.pull) starts after the step's forward: a handshake with the prefill engine on a
worker thread the first time (cached per engine), then one NIXL READ of every slab of the listed blocks.
Each later step polls it. When it is DONE, a side-channel question on the same thread -- is the lease still
held? (kv_transfer/side_channel.py) -- makes sure no block was reused while it was read; yes: the
notification "{remote_request_id}:{tp_size}" the prefill engine waits for is sent and the request reported in
finished_receiving. Anything else -- a failed handshake, ERR, no progress within the transfer timeout, a lease
that had ended -- reports it in failed_receiving (the request recomputes).

A prefill engine answers that question from the leases of the step it is running: the view is updated before
each forward (before_forward), so a lease that ended -- whose blocks a forward may then overwrite -- is out of
it before any such forward starts. The pulled blocks belong to a request
that is not scheduled until then, so no forward reads or writes them meanwhile.

Tensor parallelism: every rank holds its KV heads' shard, its own agent ("{engine_id}-tp{rank}") and side
channel (side_channel_port + rank), and pulls from the prefill engine's rank of the same index (both engines
run the same TP size; a different one fails the layout check and recomputes). The ranks agree before reporting
(one all-reduce per step while anything is pending): a pull ends when it ended on every rank, failed if it
failed on any; a lease is released once every rank got its notification.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvserve.runtime.core.outputs import KVTransfer, ModelRunnerOutput, SchedulerOutput
from kvserve.runtime.kv_transfer import nixl_agent
from kvserve.runtime.kv_transfer.config import KVTransferConfig
from kvserve.runtime.kv_transfer.side_channel import (
    LEASE_ENDED,
    LEASE_HELD,
    LEASE_UNKNOWN,
    HandshakeReply,
    SideChannelServer,
    compat_hash,
    fetch_metadata,
    lease_held,
)
from kvserve.runtime.models.attention import TOKEN_LAYOUT
from kvserve.runtime.models.parallel_layers import SINGLE, ParallelContext

logger = logging.getLogger("kvserve.kv_transfer")

SEEN_LEASES_KEPT = 100_000
TRANSFER_TIMEOUT_S = 60.0  # a READ still in progress after this is declared failed
# A step that ran nothing only polls transfers (leases held, pulls in flight): it sleeps this long instead of
# spinning, which bounds the idle engine loop (and its stats messages) to ~200 steps/s; a request arriving
# meanwhile waits at most this long more.
IDLE_POLL_S = 0.005


@dataclass
class _Remote:
    name: str  # the NIXL agent name add_remote_agent returned
    reply: HandshakeReply


@dataclass
class _Pull:
    transfer: KVTransfer
    handle: object = None
    started: float = 0.0
    check: Future | None = None  # the lease check once the READ is done
    ok: bool | None = None  # None: not ended on this rank


class KVPullWorker:
    def __init__(
        self,
        kv: torch.Tensor,
        config: KVTransferConfig,
        parallel: ParallelContext = SINGLE,
        kv_block_layout: str = TOKEN_LAYOUT,
    ):
        """kv: the runner's KV tensor [2, layers, blocks, block_size, heads, head_dim] (this rank's heads), its
        blocks' elements in kv_block_layout's order (the attention backend's, models/attention.py)."""
        if kv.device.type != "cpu":  # the VRAM path is the same calls with "VRAM", not exercised here
            raise NotImplementedError("P/D disaggregation over NIXL is implemented for a CPU KV cache only")
        self.config = config
        self.parallel = parallel
        self.tp_rank, self.tp_size = parallel.rank, parallel.size
        name = config.engine_id if parallel.size == 1 else f"{config.engine_id}-tp{parallel.rank}"
        self.agent = nixl_agent.make_agent(name, config.backends)
        self.kv = kv
        self._registered = self.agent.register_memory(kv)
        self.num_slabs = kv.shape[0] * kv.shape[1]
        self.num_blocks = kv.shape[2]
        self.block_bytes = kv[0, 0, 0].numel() * kv.element_size()
        self.compat = compat_hash(tuple(kv.shape[:2]) + tuple(kv.shape[3:]), str(kv.dtype), kv_block_layout)
        self.side_channel = None
        self._leased_view: frozenset[str] = frozenset()  # prefill: the leases of the step now running
        self._seen: dict[str, None] = {}  # prefill: leases some step listed, most recent last (bounded)
        if config.is_producer:
            reply = HandshakeReply(
                self.compat,
                config.engine_id,
                self.agent.get_agent_metadata(),
                kv.data_ptr(),
                self.num_slabs,
                self.num_blocks,
                self.block_bytes,
            )
            self.side_channel = SideChannelServer(
                config.side_channel_host, config.side_channel_port + self.tp_rank, reply, self._is_leased
            )
        self._remotes: dict[str, _Remote] = {}  # engine id -> handshake done
        self._handshakes: dict[str, Future] = {}  # engine id -> handshake running
        self._handshaker = ThreadPoolExecutor(2, thread_name_prefix="kvserve-nixl-handshake")
        self._pulls: dict[str, _Pull] = {}  # req id -> pull not yet reported
        self._notified: set[str] = set()  # prefill: leases this rank got the notification for, not yet released

    # -- per step ------------------------------------------------------------------------------------------
    def before_forward(self, sched: SchedulerOutput) -> None:
        """Before this step's forward can overwrite a block whose lease just ended, stop vouching for it."""
        view = frozenset(sched.kv_connector.leased)
        for rid in view - self._leased_view:
            self._seen[rid] = None
        while len(self._seen) > SEEN_LEASES_KEPT:  # forgotten ones answer UNKNOWN: the asker recomputes
            del self._seen[next(iter(self._seen))]
        self._leased_view = view

    def _is_leased(self, request_id: str) -> int:  # the side channel's thread
        if request_id in self._leased_view:
            return LEASE_HELD
        return LEASE_ENDED if request_id in self._seen else LEASE_UNKNOWN

    def after_forward(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> None:
        for rid, transfer in sched.kv_connector.pull.items():
            self._pulls[rid] = _Pull(transfer)
            self._handshake(transfer.remote)
        self._progress()
        done, failed = self._agreed_pulls()
        out.finished_receiving = out.finished_receiving | done
        out.failed_receiving = {**out.failed_receiving, **failed}
        released = self._agreed_releases(sched.kv_connector.leased)
        if released:
            out.finished_sending = out.finished_sending | released
        if not sched.scheduled and not done and not failed and not released:
            time.sleep(IDLE_POLL_S)

    def _handshake(self, remote: dict) -> None:
        engine = remote["remote_engine_id"]
        if engine in self._remotes or engine in self._handshakes:
            return
        self._handshakes[engine] = self._handshaker.submit(
            fetch_metadata,
            remote["remote_host"],
            remote["remote_port"] + self.tp_rank,
            self.tp_rank,
            self.config.handshake_timeout_s,
        )

    def _progress(self) -> None:
        """Advance this rank's handshakes and pulls; a pull that ended gets its `ok`."""
        failed_engines: set[str] = set()
        for engine, future in list(self._handshakes.items()):
            if not future.done():
                continue
            del self._handshakes[engine]
            try:
                reply = future.result()
                if reply.compat_hash != self.compat:
                    raise ValueError(f"incompatible KV layout (compat hash {reply.compat_hash} != {self.compat})")
                self._remotes[engine] = _Remote(self.agent.add_remote_agent(reply.agent_metadata), reply)
            except Exception as exc:  # noqa: BLE001 -- any failure: the requests recompute locally
                logger.warning("NIXL handshake with prefill engine %s failed: %s", engine, exc)
                failed_engines.add(engine)
        now = time.monotonic()
        for rid, pull in self._pulls.items():
            if pull.ok is not None:
                continue
            engine = pull.transfer.remote["remote_engine_id"]
            ok: bool | None = None
            try:
                if engine in failed_engines:
                    ok = False
                elif pull.handle is None and engine in self._remotes:
                    ok = self._start(pull, self._remotes[engine], now)
                elif pull.check is not None:
                    if pull.check.done():
                        ok = self._checked(rid, pull)
                elif pull.handle is not None:
                    state = self.agent.check_xfer_state(pull.handle)
                    if state == "DONE":
                        self._check_lease(pull)
                    elif state != "PROC" or now - pull.started > TRANSFER_TIMEOUT_S:
                        logger.warning("NIXL READ for request %s ended in state %s", rid, state)
                        ok = False
            except Exception as exc:  # noqa: BLE001
                logger.warning("NIXL pull for request %s failed: %s", rid, exc)
                ok = False
            if ok is None:
                continue
            pull.ok = ok
            if pull.handle is not None:
                try:
                    self.agent.release_xfer_handle(pull.handle)
                except Exception:  # noqa: BLE001 -- an errored handle may refuse release; nothing to keep
                    pass
            if not ok:
                self._forget(engine)

    def _agreed_pulls(self) -> tuple[set[str], dict[str, list[int]]]:
        """Pulls that ended on every rank: done, or failed (on any rank: then the request recomputes)."""
        rids = sorted(self._pulls)  # the same pulls on every rank (the same SchedulerOutputs)
        if not rids:
            return set(), {}
        ended = [int(self._pulls[r].ok is not None) for r in rids]
        intact = [int(self._pulls[r].ok is not False) for r in rids]
        ended, intact = self._all_min(ended), self._all_min(intact)
        done: set[str] = set()
        failed: dict[str, list[int]] = {}
        for rid, e, i in zip(rids, ended, intact):
            if not e:
                continue
            pull = self._pulls.pop(rid)
            if i:
                done.add(rid)
            else:
                failed[rid] = list(range(len(pull.transfer.block_ids)))
        return done, failed

    def _agreed_releases(self, leased: list[str]) -> set[str]:
        """Prefill side: leases every rank got the decode engine's notification for."""
        self._notified |= self._new_notifications()
        if not leased:
            self._notified.clear()
            return set()
        self._notified &= set(leased)  # ended meanwhile (expired): forget
        flags = self._all_min([int(rid in self._notified) for rid in leased])
        released = {rid for rid, f in zip(leased, flags) if f}
        self._notified -= released
        return released

    def _all_min(self, values: list[int]) -> list[int]:
        """Element-wise minimum over the tensor-parallel ranks (the values themselves with one rank)."""
        if self.parallel.size == 1:
            return values
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.parallel.group)
        return t.tolist()

    def _notification(self, pull: _Pull) -> bytes:
        return f"{pull.transfer.remote['remote_request_id']}:{self.tp_size}".encode()

    def _check_lease(self, pull: _Pull) -> None:
        r = pull.transfer.remote
        pull.check = self._handshaker.submit(
            lease_held,
            r["remote_host"],
            r["remote_port"] + self.tp_rank,
            r["remote_request_id"],
            self.config.handshake_timeout_s,
        )

    def _checked(self, rid: str, pull: _Pull) -> bool:
        """The READ is done and the lease check answered: notify and succeed if the lease was still held."""
        if not pull.check.result():  # raises what the check raised (a timeout): the caller fails the pull
            logger.warning("request %s: the prefill engine's lease ended before the pull was verified", rid)
            return False
        self.agent.send_notif(self._remotes[pull.transfer.remote["remote_engine_id"]].name, self._notification(pull))
        return True

    def _start(self, pull: _Pull, remote: _Remote, now: float) -> bool | None:
        """Post the READ; True when there is nothing to read (only the notification to send)."""
        t, reply = pull.transfer, remote.reply
        remote_ids = t.remote["remote_block_ids"]
        if not t.block_ids:
            self.agent.send_notif(remote.name, self._notification(pull))
            return True
        if len(remote_ids) != len(t.block_ids) or max(remote_ids) >= reply.num_blocks:
            raise ValueError(f"remote_block_ids {remote_ids} do not fit the prefill engine's {reply.num_blocks}")
        local = nixl_agent.block_descs(
            self.kv.data_ptr(), self.num_slabs, self.num_blocks, self.block_bytes, t.block_ids
        )
        far = nixl_agent.block_descs(reply.base_addr, reply.num_slabs, reply.num_blocks, reply.block_bytes, remote_ids)
        handle = self.agent.initialize_xfer(
            "READ",
            self.agent.get_xfer_descs(local, "DRAM"),
            self.agent.get_xfer_descs(far, "DRAM"),
            remote.name,
        )
        pull.handle, pull.started = handle, now
        state = self.agent.transfer(handle)
        if state == "ERR":
            return False
        if state == "DONE":
            self._check_lease(pull)
        return None

    def _forget(self, engine: str) -> None:
        """After a failure, the next pull from this engine handshakes again (it may have restarted)."""
        remote = self._remotes.pop(engine, None)
        if remote is not None:
            try:
                self.agent.remove_remote_agent(remote.name)
            except Exception:  # noqa: BLE001
                pass

    def _new_notifications(self) -> set[str]:
        """Prefill side: requests whose KV a decode engine's rank finished reading ("{req id}:{tp size}")."""
        released = set()
        for messages in self.agent.get_new_notifs().values():
            for msg in messages:
                rid, _, _ = msg.decode(errors="replace").rpartition(":")
                released.add(rid)
        return released

    def shutdown(self) -> None:
        if self.side_channel is not None:
            self.side_channel.close()
        self._handshaker.shutdown(wait=False, cancel_futures=True)

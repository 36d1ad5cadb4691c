"""MultiprocExecutor: tensor parallelism with every rank in its own spawned worker process.

The engine process keeps the tokenizer, the scheduler and the KV-cache manager (they run once); each step it
pickles the plain-data SchedulerOutput once and sends the same bytes to every rank; all ranks run the same
forward (their collectives keep them in step); rank 0 gathers the logits, samples and returns the
ModelRunnerOutput; the others answer None. The SchedulerOutput is a diff (core/block_table_diff.py): every
rank's runner keeps the block tables and applies the same diffs in the same order, so a decode step ships
a few bytes per request instead of every block table (measured: 14.0 KiB instead of 20.3 KiB per step at
256 decodes of 128-token prompts; the full tables grow with context length, the diffs do not).

Why rank 0 is a worker too, not the engine process (nano-vllm and vLLM's uniprocess-rank-0 layout): the
engine process then never sits inside a collective. When any rank dies, the survivors can block in an
all-reduce forever (NCCL has no timeout that fires reliably); the engine, waiting only on pipes and process
sentinels with a deadline, notices the death at once, kills the other ranks and raises WorkerDiedError naming
the rank -- it never hangs. The price is one more process and one pickle round trip per step (the
SchedulerOutput out, a dict of token ids back), small next to a forward.

Memory: each rank holds 1/t of the weights (norms and row-parallel biases are replicated) and its own KV
cache. `kv_cache_bytes` / `gpu_memory_utilization` are budgets **per rank** (per GPU), as the operator plans
them: a KV block on one rank holds only that rank's KV heads, so the same byte budget holds ~t times more
blocks than with t=1 (fewer when KV heads are replicated, see sharding.py). All ranks use the minimum block
count any rank found.

Pipeline parallelism keeps several batches in flight (EngineCore._step_pipelined): `submit` sends a batch to
every rank and returns at once, `collect` waits for that batch's replies. Each rank answers its calls in order, so
the replies on every pipe arrive oldest batch first; stage 0 reads batch n+1 from its pipe as soon as it has
handed batch n's hidden states on, and works on it while stage 1 still runs batch n.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import tempfile
import time
import weakref
from collections import deque
from multiprocessing.connection import wait
from typing import TYPE_CHECKING

from kvserve.runtime.capacity import tp_shape_error
from kvserve.runtime.child_process import describe_exit
from kvserve.runtime.config import EngineConfig
from kvserve.runtime.core.outputs import ModelRunnerOutput, SchedulerOutput
from kvserve.runtime.errors import InvalidParameter, WorkerDiedError
from kvserve.runtime.executor.rank_info import RankInfo
from kvserve.runtime.executor.worker_rpc import (
    DescribeRank,
    Execute,
    ExecuteIntervals,
    Shutdown,
    Sleep,
    WakeUp,
    WorkerCall,
    WorkerFailure,
)
from kvserve.runtime.models.registry import split_widths
from kvserve.runtime.models.sharding import split_widths_error

if TYPE_CHECKING:
    from kvserve.runtime.executor.lora_calls import WorkerLoraManagers

logger = logging.getLogger("kvserve.parallel")

# Loading a 70B shard from network storage can take tens of minutes; a step (with Triton JIT on the first
# one) minutes. Both only bound a rank that is alive but silent: a dead rank is noticed immediately.
DEFAULT_STARTUP_TIMEOUT_S = float(os.environ.get("KVSERVE_TP_STARTUP_TIMEOUT_S", 3600))
DEFAULT_STEP_TIMEOUT_S = float(os.environ.get("KVSERVE_TP_STEP_TIMEOUT_S", 600))


class MultiprocExecutor:
    """The Executor (executor/base.py) of a world of several ranks, one worker process each."""

    def __init__(
        self,
        config: EngineConfig,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
    ):
        import torch
        import torch.multiprocessing as mp

        t = config.tensor_parallel_size
        m = config.model
        error = tp_shape_error(m.num_heads, m.num_kv_heads, m.hf_config.intermediate_size, t) or split_widths_error(
            split_widths(m.hf_config), t
        )
        if error:
            raise InvalidParameter(
                "tensor_parallel_size", f"tensor_parallel_size={t} does not fit {m.model_dir}: {error}"
            )
        from kvserve.runtime.executor import pipeline

        world = config.world_size  # TP ranks x pipeline stages
        cuda = config.device.startswith("cuda")
        if cuda and torch.cuda.device_count() < world:
            field = "pipeline_parallel_size" if config.pipeline_parallel_size > 1 else "tensor_parallel_size"
            raise InvalidParameter(
                field,
                f"tensor_parallel_size={t} x pipeline_parallel_size={config.pipeline_parallel_size} needs "
                f"{world} GPUs, {torch.cuda.device_count()} visible",
            )
        self.config = config
        self.size = world
        self.output_rank = pipeline.output_rank(config)  # the last stage's TP rank 0 samples
        self._kind = "pipeline-parallel" if config.pipeline_parallel_size > 1 else "tensor-parallel"
        self.step_timeout_s = step_timeout_s
        self.dead: WorkerDiedError | None = None
        self._num_submitted = 0  # batches sent (their handles are 1, 2, ...)
        self._in_flight: deque[int] = deque()  # handles of batches whose replies are not read yet, oldest first
        self._collected: dict[int, ModelRunnerOutput] = {}  # replies read ahead of their collect()
        backend = "nccl" if cuda else "gloo"
        self._tmpdir = tempfile.mkdtemp(prefix="kvserve-tp-")
        init_method = "file://" + os.path.join(self._tmpdir, "rendezvous")
        nnodes = config.parallel.nnodes
        listener = None
        if nnodes > 1:  # the other nodes' ranks connect back (executor/multinode.py); this node runs ranks 0..
            from kvserve.runtime.executor import multinode

            if config.parallel.node_rank != 0:
                raise InvalidParameter("node_rank", "only node rank 0 runs the engine; the others run --headless")
            init_method = multinode.init_method(config)
            listener = multinode.RankListener(config)
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        # Registered before the first start so that whatever happens next, the workers are reaped on
        # shutdown(), garbage collection of the executor, or interpreter exit.
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns, self._tmpdir)
        from kvserve.runtime.child_process import exit_if_bootstrapping
        from kvserve.runtime.executor.tp_worker import worker_main

        exit_if_bootstrapping()  # an unguarded script re-imported in a child: one clear error in the parent

        log_level = logging.getLogger("kvserve").getEffectiveLevel()
        for rank in range(world // nnodes):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=worker_main,
                name=f"kvserve-tp-rank{rank}",
                daemon=True,
                args=(
                    config,
                    rank,
                    world,
                    backend,
                    init_method,
                    child_conn,
                    os.getpid(),
                    log_level,
                    max(step_timeout_s, 60.0),
                ),
            )
            proc.start()
            child_conn.close()
            self.procs.append(proc)
            self.conns.append(parent_conn)
        logger.info(
            "%s: started %d %s workers (pids %s), loading shards",
            self._kind,
            world,
            backend,
            ", ".join(str(p.pid) for p in self.procs),
        )
        started = time.monotonic()
        if listener is not None:
            try:
                remote = listener.accept_all(started + startup_timeout_s, list(self.procs))
            except (TimeoutError, RuntimeError) as exc:
                raise self._fail(len(self.procs), f"multi-node start-up failed: {exc}") from None
            finally:
                listener.close()
            for rank in sorted(remote):  # ranks of nodes 1.. follow this node's, in rank order
                self.procs.append(remote[rank])
                self.conns.append(remote[rank].conn)
        ranks: list[RankInfo] = self._gather(startup_timeout_s, starting=True)  # each rank's first reply
        self.num_blocks: int = ranks[0].num_blocks
        # Per rank; pipeline stages differ (their own layers' KV): the largest one, what a device must hold.
        self.kv_cache_bytes: int = max(i.kv_cache_bytes for i in ranks)
        # Swap space is a per-rank byte budget too: a stage with more layers buys fewer host blocks.
        self.num_host_blocks: int = min(i.num_host_blocks for i in ranks)
        self.kv_block_layout: str = ranks[0].kv_block_layout  # every rank runs the same backend on the same CPU kind
        self.startup_phases: dict[str, float] = dict(ranks[0].startup_phases)  # rank 0's, in seconds
        # --enable-lora: every rank's adapters, managed by the engine core's registry (executor/lora_calls.py)
        self.lora: WorkerLoraManagers | None = None
        if config.lora is not None:
            from kvserve.runtime.executor.lora_calls import WorkerLoraManagers

            executor = weakref.ref(self)  # no cycle: the finalizer still runs when the executor is dropped
            self.lora = WorkerLoraManagers(lambda call: executor()._call(call))
        logger.info(
            "%s: %d ranks ready in %.1f s; per rank: %s",
            self._kind,
            world,
            time.monotonic() - started,
            "; ".join(
                f"rank {i.rank} (stage {i.stage}, layers {i.layers[0]}-{i.layers[1] - 1}) "
                f"{i.param_bytes / 2**20:.1f} MiB weights, {i.num_heads} "
                f"q heads, KV heads {i.kv_head_ids}, {i.kv_cache_bytes / 2**20:.1f} MiB KV"
                for i in ranks
            ),
        )

    # -- engine-side API ----------------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect(self.submit(sched))

    def submit(self, sched: SchedulerOutput) -> int:
        """Send a batch to every rank without waiting for it; returns the handle collect() takes."""
        self._send(Execute(sched))
        self._num_submitted += 1
        self._in_flight.append(self._num_submitted)
        return self._num_submitted

    def collect(self, handle: int) -> ModelRunnerOutput:
        """The sampling rank's output of a submitted batch (older batches' replies are read first and kept)."""
        while handle not in self._collected:
            if not self._in_flight:
                raise ValueError(f"batch {handle} was never submitted or was collected already")
            oldest = self._in_flight.popleft()
            self._collected[oldest] = self._gather(self.step_timeout_s)[self.output_rank]
        return self._collected.pop(handle)

    def is_done(self, handle: int) -> bool:
        """Whether collect(handle) would not wait: every rank's reply to it is readable (no I/O beyond a poll)."""
        if handle in self._collected:
            return True
        return bool(self._in_flight) and self._in_flight[0] == handle and all(c.poll() for c in self.conns)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def execute_intervals(self) -> list[list[tuple[float, float]]]:
        """Per rank, (start, end) time.monotonic() of its latest executes (up to 1024), oldest first."""
        return self._call(ExecuteIntervals())

    def describe_ranks(self) -> list[RankInfo]:
        """Measured per-rank parameter / KV bytes (a round trip to every worker)."""
        return self._call(DescribeRank())

    def sleep(self, level: int) -> None:
        """Every rank frees its KV cache (and weights at level 2): executor/sleep_mode.py."""
        self._call(Sleep(level))

    def wake_up(self) -> None:
        self._call(WakeUp())

    def check_health(self) -> None:
        """Raise WorkerDiedError if the executor failed or any worker process is gone (cheap: no I/O)."""
        if self.dead is not None:
            raise self.dead
        for rank, proc in enumerate(self.procs):
            if self._in_flight and hasattr(proc, "describe"):
                continue  # a remote rank's is_alive() reads its pipe, where a batch's reply is due: collect() sees EOF
            if not proc.is_alive():
                raise self._fail(rank, f"{self._kind} worker rank {rank} (pid {proc.pid}) died ({self._exit(rank)})")

    def shutdown(self) -> None:
        """Stop every worker (idempotent); the executor is unusable afterwards."""
        if self.dead is None:
            self.dead = WorkerDiedError("the tensor-parallel executor was shut down")
        self._finalizer()

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # -- plumbing ---------------------------------------------------------------------------------------
    def _call(self, call: WorkerCall) -> list:
        """Every rank's reply to one call. Batches still in flight are read first (their replies come before
        this call's on every pipe) and kept for their collect()."""
        while self._in_flight:
            oldest = self._in_flight.popleft()
            self._collected[oldest] = self._gather(self.step_timeout_s)[self.output_rank]
        self._send(call)
        return self._gather(self.step_timeout_s)

    def _send(self, call: WorkerCall) -> None:
        if self.dead is not None:
            raise self.dead
        data = pickle.dumps(call, pickle.HIGHEST_PROTOCOL)  # pickled once for all ranks
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except OSError as exc:  # broken pipe: the worker is gone
                self.procs[rank].join(1.0)
                raise self._fail(
                    rank,
                    f"{self._kind} worker rank {rank} (pid {self.procs[rank].pid}) is not "
                    f"reachable ({self._exit(rank)})",
                ) from exc

    def _gather(self, timeout_s: float, starting: bool = False) -> list:
        """One reply from every rank; any death, error or timeout is fatal (raised as WorkerDiedError)."""
        replies: dict[int, object] = {}
        pending = {conn: rank for rank, conn in enumerate(self.conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs)}
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = sorted(pending.values())
                raise self._fail(
                    late[0],
                    f"{self._kind} worker rank(s) {late} did not answer within "
                    f"{timeout_s:.0f} s (pids {[self.procs[r].pid for r in late]})",
                )
            # A rank on another node has no process sentinel: its connection is both (listed once).
            ready = wait(list(pending) + [s for s in sentinels if s not in pending], timeout=remaining)
            # Read pipes before looking at exits: a worker that failed sent its error before exiting.
            for obj in sorted(ready, key=lambda o: not hasattr(o, "recv_bytes")):
                if obj in pending:
                    rank = pending[obj]
                    try:
                        reply = pickle.loads(obj.recv_bytes())
                    except (EOFError, OSError):
                        self.procs[rank].join(1.0)
                        self._raise_if_main_guard_exit(rank, starting)
                        raise self._fail(
                            rank,
                            f"{self._kind} worker rank {rank} (pid {self.procs[rank].pid}) died ({self._exit(rank)})",
                        ) from None
                    if isinstance(reply, WorkerFailure):
                        summary, tb, param, message = reply.summary, reply.traceback, reply.param, reply.message
                        where = "while starting" if starting else "during a step"
                        logger.error("%s worker rank %d failed %s:\n%s", self._kind, rank, where, tb)
                        if starting and param is not None:  # e.g. the KV budget cannot hold max_model_len
                            self._fail(rank, f"{self._kind} worker rank {rank} failed while starting: {summary}")
                            raise InvalidParameter(param, message)
                        killed = self._killed_peer(rank)
                        if killed is not None:  # rank's error is the symptom (a collective lost its peer)
                            proc = self.procs[killed]
                            raise self._fail(
                                killed,
                                f"{self._kind} worker rank {killed} (pid {proc.pid}) died "
                                f"({self._exit(killed)}); rank {rank} then failed: "
                                f"{summary.splitlines()[0][:200]}",
                            )
                        raise self._fail(rank, f"{self._kind} worker rank {rank} failed {where}: {summary}")
                    replies[rank] = reply.value
                    del pending[obj]
                elif obj in sentinels:
                    rank = sentinels.pop(obj)
                    if rank not in pending.values():
                        continue  # answered this call, then exited: the next call notices
                    proc = self.procs[rank]
                    proc.join(1.0)
                    self._raise_if_main_guard_exit(rank, starting)
                    raise self._fail(
                        rank,
                        f"{self._kind} worker rank {rank} (pid {proc.pid}) died ({self._exit(rank)})",
                    )
        return [replies[r] for r in range(len(self.conns))]

    def _raise_if_main_guard_exit(self, rank: int, starting: bool) -> None:
        from kvserve.runtime.child_process import MAIN_GUARD_EXIT_CODE, MainGuardError

        if starting and self.procs[rank].exitcode == MAIN_GUARD_EXIT_CODE:
            self._finalizer()
            raise MainGuardError()

    def _killed_peer(self, rank: int, grace_s: float = 0.5) -> int | None:
        """A rank other than `rank` that was killed by a signal (looked for briefly): when one rank is
        killed, its peers fail in their next collective, and the killed rank is the one to name."""
        deadline = time.monotonic() + grace_s
        while True:
            for other, proc in enumerate(self.procs):
                if other != rank and not proc.is_alive() and (proc.exitcode or 0) < 0:
                    return other
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _exit(self, rank: int) -> str:
        proc = self.procs[rank]
        describe = getattr(proc, "describe", None)  # a rank on another node (multinode.RemoteRank)
        return describe() if describe is not None else describe_exit(proc.exitcode)

    def _fail(self, rank: int, message: str) -> WorkerDiedError:
        """Record the fatal error, stop every worker, and return the error for the caller to raise."""
        if self.dead is None:
            self.dead = WorkerDiedError(
                message + f"; the engine is stopped (all {self._kind} workers were shut down)", rank
            )
            logger.error("%s", self.dead)
        self._finalizer()
        return self.dead


def _stop_workers(procs: list, conns: list, tmpdir: str, grace_s: float = 5.0) -> None:
    """Ask every worker to exit, then terminate / kill whatever is left. Never raises."""
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(Shutdown()))
        except Exception:  # noqa: BLE001 -- already gone
            pass
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.join(max(0.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001
            pass
    for proc in procs:
        try:
            if proc.is_alive():
                proc.kill()  # blocked in a collective whose peer died (workers ignore SIGTERM: tp_worker.py)
                proc.join(2.0)
        except Exception:  # noqa: BLE001
            pass
    for conn in conns:
        try:
            conn.close()
        except Exception:  # noqa: BLE001
            pass
    shutil.rmtree(tmpdir, ignore_errors=True)

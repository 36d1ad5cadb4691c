"""One tensor-parallel rank: a spawned process that joins the torch.distributed group, builds its
ModelRunner shard and then executes whatever the engine process sends over its pipe, in order.

Protocol (executor/worker_rpc.py, pickled over a multiprocessing Pipe): engine -> worker one typed call
(Execute, DescribeRank, LoraAdd, ..., Shutdown); worker -> engine a `Reply` after every call (for Execute the
sampling rank's value is the ModelRunnerOutput, other ranks send None), or one `WorkerFailure`, after which the
worker exits with code 1. The first reply, before any call, is the rank's RankInfo. A worker exits by itself
when the engine process goes away (EOF on the pipe, or its parent pid changes while it is blocked in a
collective), so a killed engine leaves no orphans.

A thread reads the pipe into an inbox while the rank computes (`_Inbox`): with pipeline parallelism the engine
sends batch n+1 while this rank still runs batch n (EngineCore._step_pipelined), and a batch larger than the
pipe's buffer must not block the engine's send until the rank's reply -- which the engine, still sending, would not
read -- gets through.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
import time
import traceback
from collections import deque
from dataclasses import replace
from datetime import timedelta

from kvserve.runtime.executor.worker_rpc import (
    DescribeRank,
    Execute,
    ExecuteIntervals,
    LoraAdd,
    LoraDescribe,
    LoraRemove,
    Reply,
    Shutdown,
    Sleep,
    WakeUp,
    WorkerFailure,
)

logger = logging.getLogger("kvserve.parallel.worker")


def _watch_parent(parent_pid: int, interval_s: float = 1.0) -> None:
    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent_pid:  # reparented: the engine process is gone
                os._exit(3)

    threading.Thread(target=watch, name="kvserve-parent-watch", daemon=True).start()


class _Inbox:
    """The engine's messages, read off the pipe by a thread as they arrive (raw bytes, in order)."""

    def __init__(self, conn):
        import queue

        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._read, args=(conn,), name="kvserve-worker-inbox", daemon=True).start()

    def _read(self, conn) -> None:
        try:
            while True:
                self._queue.put(conn.recv_bytes())
        except (EOFError, OSError) as exc:  # the engine went away (or closed the pipe on shutdown)
            self._queue.put(exc)

    def recv_bytes(self) -> bytes:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise EOFError from item
        return item


def worker_main(
    config,
    rank: int,
    size: int,
    backend: str,
    init_method: str,
    conn,
    parent_pid: int,
    log_level: int,
    collective_timeout_s: float,
    eof_exit_code: int = 0,
) -> None:
    """eof_exit_code: the exit code when the engine's side of `conn` closes without a shutdown (a rank on a
    headless node then exits non-zero so its node fails the group: executor/multinode.py)."""
    _watch_parent(parent_pid)
    # Ctrl-C reaches the whole foreground process group, and so does a SIGTERM to the group (systemd, `timeout`,
    # killasgroup): the engine decides when workers stop (a server drains first), so a worker must not die of
    # a signal meant for the server. The engine stops a stuck worker with SIGKILL (multiproc.py).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [tp rank {rank}] %(name)s: %(message)s")
    try:
        import torch
        import torch.distributed as dist

        from kvserve.runtime.executor import lora_calls, pipeline
        from kvserve.runtime.executor.model_runner import ModelRunner
        from kvserve.runtime.executor.rank_info import measure_rank

        if config.device.startswith("cuda"):
            local = rank % (size // config.parallel.nnodes)  # this node's GPUs: one per local rank
            torch.cuda.set_device(local)
            config = replace(config, device=f"cuda:{local}")
        else:
            # The ranks share the host's cores: one rank per core slice instead of t ranks fighting over all.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // (size // config.parallel.nnodes)))
        from kvserve.runtime.startup_phases import timed

        init_phases: dict[str, float] = {}
        with timed(init_phases, "distributed_init"):  # the rendezvous waits for every rank to start
            dist.init_process_group(
                backend,
                init_method=init_method,
                rank=rank,
                world_size=size,
                timeout=timedelta(seconds=collective_timeout_s),
            )
        parallel = pipeline.parallel_context(config, rank)  # TP rank (within its stage) and pipeline stage
        if parallel.stage is not None:  # this stage's layers only: KV sizing and allocation count just them
            config = pipeline.stage_engine_config(config, parallel.stage.layers)
        samples = rank == pipeline.output_rank(config)
        runner = ModelRunner(config, parallel=parallel)
        runner.startup_phases.update(init_phases)
        conn.send_bytes(pickle.dumps(Reply(measure_rank(runner, rank)), pickle.HIGHEST_PROTOCOL))
        inbox = _Inbox(conn)
        # (start, end) time.monotonic() of the latest executes: one clock for the host's ranks, so a test or an
        # operator can see whether pipeline stages overlap (MultiprocExecutor.execute_intervals).
        intervals: deque[tuple[float, float]] = deque(maxlen=1024)
        while True:
            call = pickle.loads(inbox.recv_bytes())
            match call:
                case Shutdown():
                    break
                case Execute(sched):
                    started = time.monotonic()
                    out = runner.execute(sched)
                    intervals.append((started, time.monotonic()))
                    value = out if samples else None
                case ExecuteIntervals():
                    value = list(intervals)
                case DescribeRank():
                    value = measure_rank(runner, rank)
                case LoraDescribe() | LoraAdd() | LoraRemove():  # the engine core's LoRA registry
                    value = lora_calls.handle(runner, call)
                case Sleep(level):
                    value = runner.sleep(level)
                case WakeUp():
                    value = runner.wake_up()
                case _:
                    raise ValueError(f"unknown executor call {call!r}")
            conn.send_bytes(pickle.dumps(Reply(value), pickle.HIGHEST_PROTOCOL))
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the engine went away: nothing to report to
        os._exit(eof_exit_code)
    except BaseException as exc:  # noqa: BLE001 -- report anything, then die: the group is out of step
        logger.error("tensor-parallel rank %d failed: %r", rank, exc)
        try:
            failure = WorkerFailure(
                f"{type(exc).__name__}: {exc}", traceback.format_exc(), getattr(exc, "param", None), str(exc)
            )
            conn.send_bytes(pickle.dumps(failure))
            conn.close()
        except Exception:  # noqa: BLE001
            pass
        os._exit(1)
    try:
        conn.send_bytes(pickle.dumps(Reply(None)))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- shutting down anyway
        pass
    os._exit(0)

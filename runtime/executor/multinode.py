"""Multi-node start-up without Ray: the world's ranks (TP x PP) spread evenly over --nnodes nodes.

Node 0 (the leader) runs the API server, the scheduler and the MultiprocExecutor, which spawns the leader's
own ranks as before and listens on (master_addr, master_port + 1) for the ranks of the other nodes. Those run
`kvserve serve --headless --node-rank k` (`run_headless`): no API server and no scheduler, only their local
worker processes, each of which connects back to the leader's executor (multiprocessing.connection over TCP,
with an HMAC challenge on a shared key, $KVSERVE_MULTINODE_AUTHKEY) and then speaks the same pickled
protocol a local rank speaks over its pipe (tp_worker.py). torch.distributed's rendezvous is
tcp://master_addr:master_port (rank 0 hosts its store).

Failure: the group fails fast, as a Kubernetes LeaderWorkerSet expects (it recreates the whole group).
- A rank on another node that dies closes its connection: the executor, which waits on every rank's
  connection and every local rank's process sentinel, sees EOF at once, stops every rank and raises
  WorkerDiedError; the server's /health turns 503 and it exits 1 (as with a dead local rank).
- A headless node whose worker exits without having been told to shut down (the leader died, or the worker
  failed) stops its other workers and exits 1; a worker whose headless parent was killed exits within a second
  (tp_worker's parent watch).
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import threading
import time
from multiprocessing.connection import Client, Listener, wait

from kvserve.runtime.config import EngineConfig

logger = logging.getLogger("kvserve.parallel")

AUTHKEY_ENV = "KVSERVE_MULTINODE_AUTHKEY"
# Exit code of a remote worker whose connection to the leader closed without a shutdown message.
LEADER_LOST_EXIT_CODE = 4


def authkey() -> bytes:
    """The group's shared key (the same on every node). The default only keeps strangers' stray connections
    out; isolate the group's ports with a NetworkPolicy, or set the variable from a Secret."""
    return os.environ.get(AUTHKEY_ENV, "kvserve-multinode").encode()


def local_world(config: EngineConfig) -> int:
    return config.world_size // config.parallel.nnodes


def local_ranks(config: EngineConfig) -> range:
    n = local_world(config)
    return range(config.parallel.node_rank * n, (config.parallel.node_rank + 1) * n)


def init_method(config: EngineConfig) -> str:
    p = config.parallel
    return f"tcp://{p.master_addr}:{p.master_port}"


def control_address(config: EngineConfig) -> tuple[str, int]:
    return config.parallel.master_addr, config.parallel.master_port + 1


class RemoteRank:
    """Stands in for the multiprocessing.Process of a rank on another node: its connection is its sentinel
    (EOF when it dies), it cannot be killed from here, only disconnected (its node then stops it)."""

    def __init__(self, rank: int, pid: int, conn):
        self.rank, self.pid, self.conn = rank, pid, conn
        self.name = f"kvserve-remote-rank{rank}"
        self.sentinel = conn
        self.exitcode = None
        self._lost = False

    def is_alive(self) -> bool:
        """False once its connection is closed (checked between calls, when no reply is due)."""
        if self._lost:
            return False
        try:
            if self.conn.poll(0):  # nothing is due while idle: readable means EOF
                self.conn.recv_bytes()
        except (EOFError, OSError):
            self._lost = True
        return not self._lost

    def join(self, timeout: float | None = None) -> None:
        pass

    def kill(self) -> None:
        self._lost = True
        try:
            self.conn.close()
        except OSError:
            pass

    def describe(self) -> str:
        return "connection to its node lost"


class RankListener:
    """The leader's listener for the other nodes' ranks. Accepts in a thread so start-up can time out and
    notice a local rank dying meanwhile."""

    def __init__(self, config: EngineConfig):
        self.expected = set(range(config.world_size)) - set(local_ranks(config))
        self.listener = Listener(control_address(config), authkey=authkey())
        self._accepted: queue.Queue = queue.Queue()
        threading.Thread(target=self._accept_loop, name="kvserve-rank-listener", daemon=True).start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except Exception:  # noqa: BLE001 -- closed, or a peer that failed the key challenge
                if getattr(self.listener, "_listener", None) is None:
                    return
                continue
            self._accepted.put(conn)

    def accept_all(self, deadline: float, local_procs: list) -> dict[int, RemoteRank]:
        """rank -> RemoteRank for every rank of the other nodes; TimeoutError past the deadline, RuntimeError if
        a local rank died while waiting."""
        remote: dict[int, RemoteRank] = {}
        while set(remote) != self.expected:
            for proc in local_procs:
                if not proc.is_alive():
                    raise RuntimeError(f"local worker {proc.name} exited while waiting for the other nodes")
            if time.monotonic() > deadline:
                missing = sorted(self.expected - set(remote))
                raise TimeoutError(f"ranks {missing} (headless nodes) did not connect to {self.listener.address}")
            try:
                conn = self._accepted.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                kind, rank, pid = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError, ValueError, pickle.UnpicklingError):
                conn.close()
                continue
            if kind != "hello" or rank not in self.expected or rank in remote:
                logger.warning("refused a worker connection announcing rank %r", rank)
                conn.close()
                continue
            remote[rank] = RemoteRank(rank, pid, conn)
            logger.info("rank %d (pid %d on %s) joined", rank, pid, self.listener.last_accepted)
        return remote

    def close(self) -> None:
        try:
            self.listener.close()
        except OSError:
            pass


# -- the headless side ---------------------------------------------------------------------------------------
def remote_worker_main(config, rank, world, backend, address, connect_timeout_s, log_level, collective_timeout_s):
    """A rank on a headless node: connect to the leader's executor (retrying until it listens), announce the
    rank, then run tp_worker.worker_main over that connection."""
    from kvserve.runtime.executor.tp_worker import worker_main

    deadline = time.monotonic() + connect_timeout_s
    while True:
        try:
            conn = Client(address, authkey=authkey())
            break
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                os._exit(LEADER_LOST_EXIT_CODE)
            time.sleep(0.5)
    conn.send_bytes(pickle.dumps(("hello", rank, os.getpid())))
    worker_main(
        config,
        rank,
        world,
        backend,
        init_method(config),
        conn,
        os.getppid(),
        log_level,
        collective_timeout_s,
        eof_exit_code=LEADER_LOST_EXIT_CODE,
    )


def run_headless(config: EngineConfig, startup_timeout_s: float = 3600.0, step_timeout_s: float = 600.0) -> int:
    """`kvserve serve --headless`: start this node's ranks and watch them. Exit 0 when the leader shut them all
    down, 1 as soon as one exits otherwise (the others are killed: the group must restart as a whole)."""
    import multiprocessing as mp

    from kvserve.runtime.child_process import describe_exit

    ctx = mp.get_context("spawn")
    backend = "nccl" if config.device.startswith("cuda") else "gloo"
    log_level = logging.getLogger("kvserve").getEffectiveLevel()
    procs = []
    for rank in local_ranks(config):
        proc = ctx.Process(
            target=remote_worker_main,
            name=f"kvserve-tp-rank{rank}",
            daemon=True,
            args=(
                config,
                rank,
                config.world_size,
                backend,
                control_address(config),
                startup_timeout_s,
                log_level,
                max(step_timeout_s, 60.0),
            ),
        )
        proc.start()
        procs.append(proc)
    logger.info(
        "headless node %d/%d: ranks %s (pids %s) joining %s:%d",
        config.parallel.node_rank,
        config.parallel.nnodes,
        list(local_ranks(config)),
        ", ".join(str(p.pid) for p in procs),
        *control_address(config),
    )
    stopping = threading.Event()

    def on_signal(signum, frame):  # a pod stop: this node's ranks go with it (the group restarts anyway)
        stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    code = 0
    live = list(procs)
    while live and not stopping.is_set():
        wait([p.sentinel for p in live], timeout=0.5)
        for proc in [p for p in live if not p.is_alive()]:
            live.remove(proc)
            if proc.exitcode != 0:
                logger.error(
                    "headless node %d: worker %s (pid %d) exited (%s); stopping this node's ranks",
                    config.parallel.node_rank,
                    proc.name,
                    proc.pid,
                    describe_exit(proc.exitcode),
                )
                code = 1
        if code:
            break
    for proc in live:
        proc.kill()
        proc.join(2.0)
    return code

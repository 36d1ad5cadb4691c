"""`kvserve serve --api-server-count N` (N > 1): one engine core, N API-server processes on one host:port.

Tokenisation, detokenisation, stop strings, pydantic and JSON/SSE run in the API servers, so N of them
scale that front work across CPU cores while one core schedules and runs the model (vLLM's
`--api-server-count`). N = 1 never comes here: `kvserve serve` then runs one server process with its own
core (core_client.CoreClient), exactly as before.

Layout (this process is the launcher and only supervises):

    launcher -- engine core (spawned; PULL connected to every server's input + the launcher's
             |               control socket, one PUSH per server; outputs routed by client_index)
             +- API server 0..N-1 (spawned; uvicorn on its own SO_REUSEPORT socket, all bound here to
                                   the same host:port, so the kernel spreads connections; AttachedCoreClient)

- Ports: the launcher binds the N sockets (a busy port fails once, here) and hands one to each server;
  with SO_REUSEPORT the kernel balances new connections over the listening ones.
- Metrics: PROMETHEUS_MULTIPROC_DIR is a fresh directory of the group; /metrics on any server shows the
  group's sums (runtime/metrics_group.py).
- Request ids: every server makes uuid4 ids (`cmpl-<32 hex>`), unique across servers in practice; the core
  refuses an id already in use (that request alone fails).
- SIGTERM / SIGINT to the launcher: forwarded once to every API server (each drains as a single server
  does: /health 503, in-flight requests finish, exit 0); then the core gets SHUTDOWN; exit 0. A second
  signal is forwarded as SIGUSR1 (finish fast: abort in flight, still answer it), a third kills the servers.
  API servers run in their own process group, so a terminal's Ctrl-C reaches them only through the launcher;
  a cgroup stop (systemd KillMode=control-group) reaches them directly as well, so in a group a server
  counts any number of SIGTERM/SIGINT as one: only the launcher escalates.
- Core death: every API server sees it (pidfd), answers 503 engine_dead, exits 1; the launcher exits 1.
- An API server dies (or exits unasked): the group is broken; the others get SIGTERM (they drain: their
  in-flight requests finish, bounded by --drain-timeout), the core is stopped, the launcher exits 1.
  Requests the dead server had in the core keep running until the core stops.
- The launcher killed (SIGKILL): the core watches the launcher's pid and leaves within 0.5 s, and the API
  servers follow as on core death.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time

logger = logging.getLogger("kvserve.server.group")

CORE_DEATH_GRACE_S = 15.0  # API servers answer everyone and exit within DEAD_EXIT_GRACE_S (5 s) of core death
STOP_GRACE_S = 15.0  # beyond the drain timeout: then whatever is left is killed
CORE_SHUTDOWN_GRACE_S = 10.0


def listen_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` sockets bound to host:port with SO_REUSEPORT (asyncio calls listen() in each server)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            sock.set_inheritable(True)
            sockets.append(sock)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def run_api_server_group(
    server_config, engine_args, *, host: str, port: int, count: int, log_level: str = "info"
) -> int:
    import zmq

    from kvserve.runtime.child_process import start_with_signals_blocked
    from kvserve.runtime.config import build_engine_config
    from kvserve.runtime.engine.attached_core_client import CoreAttachment
    from kvserve.runtime.engine.core_process import run_engine_core
    from kvserve.runtime.server.api_server import GROUP_STOP_SIGNALS
    from kvserve.runtime.server.termination import write_termination_message
    from kvserve.runtime.tokenizer import load_tokenizer

    try:
        engine_config = build_engine_config(engine_args)
        vocab_size = len(load_tokenizer(engine_config.model.model_dir))
    except Exception as exc:  # noqa: BLE001 -- one line for the pod, as a single server writes it
        logger.error("%s", write_termination_message(exc))
        return 1
    try:
        listeners = listen_sockets(host, port, count)
    except OSError as exc:
        logger.error("cannot bind %s:%d: %s", host, port, exc)
        return 1
    group_dir = tempfile.mkdtemp(prefix="kvserve-group-")  # 0700: the ipc sockets and the metric files
    metrics_dir = os.path.join(group_dir, "metrics")
    os.mkdir(metrics_dir)
    attachments = [
        CoreAttachment(i, f"ipc://{group_dir}/input-{i}", f"ipc://{group_dir}/output-{i}", 0) for i in range(count)
    ]
    ctx = zmq.Context()
    control = ctx.socket(zmq.PUSH)  # the launcher's own input to the core: SHUTDOWN once the servers are gone
    control.setsockopt(zmq.LINGER, 1000)
    control.bind(f"ipc://{group_dir}/control")
    status = ctx.socket(zmq.PULL)  # the core's READY / STARTUP_FAILED / DEAD, for the termination message
    status.bind(f"ipc://{group_dir}/status")
    level = logging.getLogger("kvserve").getEffectiveLevel()
    # spawn, not the forkserver CoreClient uses: the core is then this process's own child (its sentinel is the
    # core's, not a forkserver's pipe), and a SIGTERM to the process group cannot kill a forkserver under it.
    spawn = multiprocessing.get_context("spawn")
    core = spawn.Process(
        target=run_engine_core,
        name="kvserve-engine-core",
        args=(
            engine_config,
            [a.input_address for a in attachments] + [f"ipc://{group_dir}/control"],
            [a.output_address for a in attachments],
            os.getpid(),
            level,
            vocab_size,
            f"ipc://{group_dir}/status",
        ),
        kwargs={"spawned_monotonic": time.monotonic()},  # the engine_process_start phase (startup_phases.py)
    )
    start_with_signals_blocked(core, (signal.SIGTERM, signal.SIGINT))  # the core ignores both once it runs
    logger.info("engine core process %d started; starting %d API servers on http://%s:%d", core.pid, count, host, port)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # before any API server imports prometheus_client
    servers = []
    try:
        for i, sock in enumerate(listeners):
            config = dataclasses.replace(server_config, api_server_index=i, api_server_count=count, group_dir=group_dir)
            proc = spawn.Process(
                target=_api_server_main,
                name=f"kvserve-api-server-{i}",
                args=(
                    config,
                    engine_config,
                    dataclasses.replace(attachments[i], core_pid=core.pid),
                    sock,
                    host,
                    port,
                    log_level,
                ),
            )
            start_with_signals_blocked(proc, GROUP_STOP_SIGNALS)  # drain handlers unblock them (api_server.py)
            servers.append(proc)
            logger.info("API server %d: pid %d", i, proc.pid)
        for sock in listeners:
            sock.close()  # the servers hold them now; a dead server's socket must not keep taking connections
        exit_code = _supervise(core, servers, control, server_config.drain_accept_s + server_config.drain_timeout_s)
        _report_startup_failure(status)
        return exit_code
    finally:
        for proc in servers:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        _stop_core(core, control)
        control.close(linger=0)
        status.close(linger=0)
        ctx.term()
        shutil.rmtree(group_dir, ignore_errors=True)


def _report_startup_failure(status) -> None:
    """If the core could not start (e.g. a rejected KV plan), write its reason as the termination message,
    after every API server has exited: a server still starting when the core failed may have missed the
    core's message and written a vaguer one."""
    import zmq

    from kvserve.runtime.engine.core_messages import MessageCodec, MessageType, failure_exception
    from kvserve.runtime.server.termination import write_termination_message

    codec = MessageCodec()
    while True:
        try:
            kind, body = codec.decode(status.recv(flags=zmq.NOBLOCK))
        except zmq.Again:
            return
        if kind is MessageType.STARTUP_FAILED:
            logger.error("%s", write_termination_message(failure_exception(body, RuntimeError)))
            return


def _api_server_main(
    config, engine_config, attachment, sock: socket.socket, host: str, port: int, log_level: str
) -> None:
    """One API server (a spawned process): uvicorn on the launcher's socket, attached to the shared core."""
    os.setpgrp()  # signals come from the launcher only (see the module docstring)
    logging.basicConfig(
        level=log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s[api-server {attachment.client_index}]: %(message)s",
    )
    from kvserve.runtime.engine.attached_core_client import AttachedCoreClient
    from kvserve.runtime.server.api_server import run_server

    def load_engine():
        return AttachedCoreClient(engine_config, attachment)

    sys.exit(run_server(config, host=host, port=port, engine_factory=load_engine, log_level=log_level, sockets=[sock]))


def _supervise(core, servers: list, control, drain_timeout_s: float) -> int:
    """Wait until every API server has exited; returns the group's exit status."""
    from kvserve.runtime.child_process import describe_exit
    from kvserve.runtime.server.api_server import FINISH_FAST_SIGNAL

    state = {"signals": 0, "stopping": False}
    failed = False
    deadline: float | None = None
    live = list(servers)

    def stop_servers(sig: int = signal.SIGTERM) -> None:
        nonlocal deadline
        for proc in live:
            if proc.is_alive():
                os.kill(proc.pid, sig)
        if deadline is None:
            deadline = time.monotonic() + drain_timeout_s + STOP_GRACE_S

    def on_signal(sig: int, frame) -> None:
        state["signals"] += 1
        logger.info(
            "%s received: %s %d API server(s)",
            signal.Signals(sig).name,
            "draining" if state["signals"] == 1 else "stopping now",
            len(live),
        )
        state["stopping"] = True
        if state["signals"] == 1:
            stop_servers()  # each drains; one that also got the signal itself counts it once
        elif state["signals"] == 2:
            stop_servers(FINISH_FAST_SIGNAL)  # finish fast: abort in flight, still answer it
        else:
            for proc in live:
                if proc.is_alive():
                    proc.kill()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    core_gone = False
    while live:
        watched = [proc.sentinel for proc in live] + ([] if core_gone else [core.sentinel])
        ready = multiprocessing.connection.wait(watched, timeout=0.5)
        if not core_gone and core.sentinel in ready:
            core.join(1)
            core_gone, failed = True, True
            state["stopping"] = True  # each server answers 503 engine_dead and exits by itself: no SIGTERM
            logger.error(
                "the engine core process died (%s): every API server answers 503 and exits 1",
                describe_exit(core.exitcode),
            )
            deadline = min(deadline or float("inf"), time.monotonic() + CORE_DEATH_GRACE_S)
        for proc in [p for p in live if p.sentinel in ready]:
            proc.join(1)
            live.remove(proc)
            if proc.exitcode != 0 or not state["stopping"]:
                if not failed and not core_gone:
                    logger.error(
                        "%s exited (%s): stopping the other API servers", proc.name, describe_exit(proc.exitcode)
                    )
                failed = True
                if not state["stopping"]:
                    state["stopping"] = True
                    stop_servers()
        if deadline is not None and time.monotonic() > deadline:
            for proc in live:
                logger.error("%s did not exit in time: killing it", proc.name)
                proc.kill()
                proc.join(5)
            failed = True
            live = []
    core_failed = _stop_core(core, control)
    return 1 if failed or core_failed else 0


def _stop_core(core, control) -> bool:
    """SHUTDOWN through the control socket (the core ignores SIGTERM); terminate / kill if it stays.
    Returns True when the core ended badly. Idempotent."""
    from kvserve.runtime.engine.core_client import escalate_stop
    from kvserve.runtime.engine.core_messages import MessageType

    if core.exitcode is None and core.is_alive():
        try:
            control.send(MessageType.SHUTDOWN.value)
        except Exception:  # noqa: BLE001
            pass
        core.join(CORE_SHUTDOWN_GRACE_S)
        escalate_stop(core)
    return core.exitcode not in (0, None)

"""Run the app under uvicorn with a Kubernetes-friendly SIGTERM drain.

On the first SIGTERM (or SIGINT): /health turns 503 (readiness fails, the Service stops routing here); for
`drain_accept_s` (--drain-accept-seconds, default 0) new requests are still accepted, so a load balancer that
notices the stop late (no preStop hook) sends nothing into a 503; then new requests get 503 with
`Connection: close`, in-flight requests run to completion for up to `drain_timeout_s` (then they are aborted
with finish_reason "abort"), and the process exits 0. A second signal finishes fast: the accept window ends,
the requests in flight are aborted at once (each still answered, finish_reason "abort") and the exit is 0; a
third exits at once.

When the engine dies (a tensor-parallel worker died, or too many engine steps failed in a row), /health
turns 503 and every in-flight and queued request is answered with a 503 error at once; once those answers
are out (at most DEAD_EXIT_GRACE_S) the process exits 1, so Kubernetes restarts the pod (vLLM does the same).

uvicorn's own handler would close the listening socket immediately (new clients would see connection
refused instead of a clean 503) and re-raise the signal on exit (exit status 143, not 0); so the server
overrides it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from types import FrameType
from typing import Any, Callable

import uvicorn

from kvserve.runtime.server.app import build_app
from kvserve.runtime.server.state import ServerConfig, ServerState

logger = logging.getLogger("kvserve.server")

DEAD_EXIT_GRACE_S = 5.0  # after the engine died: time for the error responses to reach their clients


# In an API-server group the launcher forwards the first stop signal as SIGTERM and a second one as this, so a
# server that also got the SIGTERM itself (a cgroup stop reaches every process) does not count it twice.
FINISH_FAST_SIGNAL = signal.SIGUSR1
# A group member is spawned with these blocked (child_process.start_with_signals_blocked): one that
# arrives while the server is still importing or loading waits, pending, until the drain handlers are in place,
# instead of killing the process with the default action; they are blocked again once serving is over, so a late
# cgroup stop cannot kill a server that is already exiting 0.
GROUP_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, FINISH_FAST_SIGNAL})


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, *, group_member: bool = False):
        super().__init__(config)
        self.state = state
        self.group_member = group_member  # stop signals: SIGTERM/SIGINT drain (any number), SIGUSR1 finishes fast
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._signals = 0
        self._accept_over: asyncio.Event | None = None  # set when the accept window ends (early: second signal)

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        if self.group_member:
            self._loop.add_signal_handler(FINISH_FAST_SIGNAL, self._finish_fast_from_launcher)
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        if not self.group_member:
            with super().capture_signals():
                yield
            return
        try:
            with super().capture_signals():
                signal.pthread_sigmask(signal.SIG_UNBLOCK, GROUP_STOP_SIGNALS)  # a pending stop is handled now
                try:
                    yield
                finally:
                    signal.pthread_sigmask(signal.SIG_BLOCK, GROUP_STOP_SIGNALS)
        finally:
            # Served and exiting. Threads started while serving inherited the main thread's unblocked mask, and
            # uvicorn has put the default handlers back: a stop signal reaching one of those threads now (a
            # cgroup-wide SIGTERM sent twice) would kill the process mid-exit and fail the group's exit status.
            # The launcher still ends a member that hangs here (SIGKILL after its grace).
            for sig in GROUP_STOP_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)

    def _finish_fast_from_launcher(self) -> None:
        logger.warning("the launcher got a second signal: finishing fast (aborting what is in flight)")
        self._signals = max(self._signals, 2)
        self._finish_fast()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the main thread, which is also the event loop's thread; do not re-raise the signal later.
        if self.group_member and self._loop is not None:
            if self._drain_task is None:
                logger.info("%s received: draining", signal.Signals(sig).name)
                self._loop.call_soon_threadsafe(self._start_drain)
            return  # the launcher and a cgroup stop may both send it: only the launcher's SIGUSR1 escalates
        self._signals += 1
        if self._signals == 2 and self._loop is not None:
            logger.warning("second signal %s: finishing fast (aborting what is in flight)", signal.Signals(sig).name)
            self._loop.call_soon_threadsafe(self._finish_fast)
            return
        if self._signals > 1 or self._loop is None:
            logger.warning("signal %s again: exiting now", signal.Signals(sig).name)
            self.should_exit = True
            self.force_exit = True
            return
        logger.info("%s received: draining", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_drain)

    def fatal(self, exc: BaseException) -> None:
        self.exit_code = 1
        self.should_exit = True

    def engine_dead(self, exc: BaseException) -> None:
        """Runs in the event loop after every request got its error: let them flush, then exit 1."""
        self.exit_code = 1
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._exit_when_answered())

    async def _exit_when_answered(self) -> None:
        engine = self.state.engine
        deadline = time.monotonic() + DEAD_EXIT_GRACE_S
        while engine is not None and engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # let the last error bodies / SSE events flush
        logger.error("engine dead: exiting with status 1 so the pod is restarted")
        self.should_exit = True

    def _finish_fast(self) -> None:
        """The second signal: every request in flight is answered now (finish_reason "abort", its stream
        closed properly), then the drain ends as usual and the exit is still 0."""
        self._start_drain()
        if self._accept_over is not None:
            self._accept_over.set()
        self.state.draining = True  # nothing new from now on, even inside the accept window
        engine = self.state.engine
        if engine is not None and engine.num_in_flight:
            engine.abort_all()

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        state = self.state
        state.stopping = True  # /health 503 from now on
        if state.metrics is not None:
            state.metrics.draining.set(1)
        accept_s = state.config.drain_accept_s
        if accept_s > 0 and not state.draining:
            logger.info("stopping: /health is 503; still accepting new requests for %.0f s", accept_s)
            self._accept_over = asyncio.Event()
            try:
                await asyncio.wait_for(self._accept_over.wait(), accept_s)
            except asyncio.TimeoutError:
                pass
        state.draining = True
        engine = state.engine
        timeout = state.config.drain_timeout_s
        in_flight = engine.num_in_flight if engine is not None else 0
        logger.info("draining: %d request(s) in flight, waiting up to %.0f s; new requests get 503", in_flight, timeout)
        deadline = time.monotonic() + timeout
        while engine is not None and engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if engine is not None and engine.num_in_flight:
            logger.warning("drain timeout: aborting %d request(s) still in flight", engine.num_in_flight)
            engine.abort_all()
            wait_until = time.monotonic() + 2.0
            while engine.num_in_flight and time.monotonic() < wait_until:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)  # let the last responses flush
        logger.info("drained; shutting down")
        self.should_exit = True


def run_server(
    config: ServerConfig,
    *,
    host: str,
    port: int,
    engine_factory: Callable[[], Any] | None = None,
    engine: Any = None,
    log_level: str = "info",
    uvicorn_kwargs: dict | None = None,
    sockets: list | None = None,
) -> int:
    """`sockets`: listening sockets bound by the caller (the API-server group's launcher) instead of host:port."""
    app = build_app(config, engine=engine, engine_factory=engine_factory)
    state: ServerState = app.state.kvserve
    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=max(5, int(config.drain_timeout_s)),  # counted after drain() returns
        timeout_keep_alive=5,
        **(uvicorn_kwargs or {}),
    )
    server = DrainingServer(uv_config, state, group_member=config.api_server_count > 1)
    state.on_fatal = server.fatal
    state.on_engine_dead = server.engine_dead
    server.run(sockets=sockets)
    if state.load_error is not None:
        from kvserve.runtime.server.termination import write_termination_message

        logger.error("%s", write_termination_message(state.load_error))
        return 1
    return server.exit_code

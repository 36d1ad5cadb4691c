"""CoreClient: the API-server side of the engine-core process. An EngineClient like LLMEngine (what AsyncEngine
drives: add_request, abort_request, step, get_stats, check_health, shutdown), so the whole async front -- the
per-request streams, metrics, tracing, the failure semantics -- is the same whichever side the core runs on.

Tokenisation, validation against the core's limits and grammar compilation happen here, in the engine front
it shares with LLMEngine (engine/front.py); detokenisation and stop strings too (RequestTracker); the core
gets token ids and sends back new token ids per sample per step.

`step()` waits (up to STEP_POLL_S) for the core's next outputs, for a `notify()` (a new request or abort to
send), or for the core process to exit. Core death -- a DEAD message (soft: the core caught its error) or
the process gone (hard: SIGKILL, OOM) -- raises EngineDeadError (WorkerDiedError when a tensor-parallel worker
died), which AsyncEngine turns into errors for every request, /health 503 and exit 1.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing
import os
import pickle
import shutil
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future

from kvserve.runtime.child_process import describe_exit, exit_if_bootstrapping, raise_if_main_guard_exit
from kvserve.runtime.config import EngineConfig
from kvserve.runtime.engine.client import PromptInput
from kvserve.runtime.engine.core_messages import (
    EngineCoreAbort,
    EngineCoreOutputs,
    EngineCoreRequest,
    MessageCodec,
    MessageType,
    UtilityCall,
    failure_exception,
)
from kvserve.runtime.engine.front import EngineFront
from kvserve.runtime.engine.request_tracker import RequestTracker
from kvserve.runtime.errors import EngineDeadError
from kvserve.runtime.outputs import EngineStats, RequestOutput
from kvserve.runtime.sampling_params import SamplingParams
from kvserve.runtime.tokenizer import load_tokenizer

logger = logging.getLogger("kvserve.engine.client")

STEP_POLL_S = 0.1  # step() returns empty-handed after this long without outputs (the caller then loops)
DEFAULT_STARTUP_TIMEOUT_S = float(os.environ.get("KVSERVE_CORE_STARTUP_TIMEOUT_S", 3600))
SHUTDOWN_GRACE_S = 10.0


class CoreClient(EngineFront):
    owns_core_process = True
    client_index = 0  # which of the core's API servers this is (runtime/server/api_server_group.py)

    def __init__(
        self,
        config: EngineConfig,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        prestarted: PrestartedCore | None = None,
    ):
        """prestarted: a core process started earlier (PrestartedCore), which gets this config instead of a
        new process being spawned now."""
        from kvserve.runtime.engine.core_process import run_engine_core

        exit_if_bootstrapping()  # before anything is created: a child re-importing an unguarded script leaves
        try:
            self.tokenizer = load_tokenizer(config.model.model_dir)
        except BaseException:
            if prestarted is not None:
                prestarted.cancel()
            raise
        self._dir = tempfile.mkdtemp(prefix="kvserve-core-")  # 0700: only this user reaches the sockets
        input_address, output_address = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self._open_sockets(input_address, output_address)

        args = (
            config,
            [input_address],
            [output_address],
            os.getpid(),
            logging.getLogger("kvserve").getEffectiveLevel(),
            len(self.tokenizer),
        )
        kwargs = {"spawned_monotonic": time.monotonic()}
        if prestarted is not None:
            try:
                self.proc = prestarted.hand_over(args, kwargs)
            except BaseException:
                close_channel((self._input, self._output), self._ctx, (self._wake_r, self._wake_w))
                shutil.rmtree(self._dir, ignore_errors=True)
                raise
        else:
            # Not a daemon: daemonic processes may not start children (the tensor-parallel workers).
            self.proc = _core_mp_context().Process(
                target=run_engine_core, name="kvserve-engine-core", args=args, kwargs=kwargs
            )
            self.proc.start()
        self._finalizer = weakref.finalize(
            self, _stop_core, self.proc, self._input, self._output, self._ctx, self._dir, (self._wake_r, self._wake_w)
        )
        self._await_core(startup_timeout_s)

    def _open_sockets(self, input_address: str, output_address: str) -> None:
        """Bind this API server's two sockets (the core connects to them) and the wake-up pipe."""
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(input_address)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(output_address)
        self._codec = MessageCodec()
        self._send_lock = threading.Lock()  # call_utility sends from the event loop's side too
        self._calls: dict[int, Future] = {}  # UTILITY calls awaiting their UTILITY_RESULT
        self._call_ids = itertools.count(1)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def _await_core(self, startup_timeout_s: float) -> None:
        """Wait for READY (watching self.proc.sentinel), then take the core's config and limits."""
        zmq = self._zmq
        self._poller = zmq.Poller()
        self._poller.register(self._output, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._poller.register(self.proc.sentinel, zmq.POLLIN)
        try:
            ready = self._wait_ready(startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.core_pid = ready.pid
        self.config: EngineConfig = pickle.loads(ready.engine_config)
        self.limits = pickle.loads(ready.limits)
        self.tracker = RequestTracker(self.tokenizer)
        self.stats: EngineStats = ready.stats
        self.startup_phases: dict[str, float] = dict(ready.startup_phases)  # the core process's, in seconds
        self.num_step_failures = 0
        self.dead_error: BaseException | None = None
        lora = self.config.lora
        # --enable-lora: this server's view of the served adapters, kept current by the core's LORA_ADAPTERS
        self.lora_adapters: dict[str, str] = dict(lora.modules) if lora is not None else {}
        # --enable-sleep-mode: the core asleep, as its SLEEP_STATE said (whichever API server put it to sleep)
        self.sleeping = False
        logger.info("engine core process %d ready", self.core_pid)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "CoreClient":
        from kvserve.runtime.config import make_engine_config

        return cls(make_engine_config(model, **kwargs))

    def _wait_ready(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            events = dict(self._poller.poll(1000))
            if self._output in events:
                kind, body = self._codec.decode(self._output.recv(copy=False).buffer)
                if kind is MessageType.READY:
                    return body
                if kind is MessageType.STARTUP_FAILED:
                    self.proc.join(5)
                    raise failure_exception(body, RuntimeError)
            if self.proc.sentinel in events or not self.proc.is_alive():
                self.proc.join(1)
                raise_if_main_guard_exit(self.proc.exitcode)
                raise RuntimeError(
                    f"the engine core process died while starting ({self._describe_core_exit()}); see its log above"
                )
        raise TimeoutError(f"the engine core did not start within {timeout_s:.0f} s (KVSERVE_CORE_STARTUP_TIMEOUT_S)")

    # -- requests (tokenise, verify, compile: EngineFront.admit) ----------------------------------------------
    prompt_tokens = property(lambda self: self.stats.prompt_tokens if self.stats else 0)
    generation_tokens = property(lambda self: self.stats.generation_tokens if self.stats else 0)

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        request = self.admit(request_id, prompt, params)  # tokenised, verified (once), grammar compiled
        arrival = time.monotonic() if arrival_time is None else arrival_time
        token_ids = request.prompt_token_ids
        parent = self.tracker.add(request_id, request.prompt, token_ids, request.params, arrival)  # before ADD
        for child in parent.children:  # back to back: the later ones hit the first one's prompt blocks
            self._send(
                MessageType.ADD,
                EngineCoreRequest.make(
                    child.request_id, token_ids, child.params, arrival, self.client_index, child.counts_prompt_tokens
                ),
            )

    def abort_request(self, request_id: str) -> None:
        child_ids = self.tracker.forget(request_id)
        if child_ids:
            self._send(MessageType.ABORT, EngineCoreAbort(child_ids))

    def has_unfinished_requests(self) -> bool:
        return bool(self.tracker.states) or bool(self._calls)  # a pending call: keep reading the core's answers

    def call_utility(self, method: str, args: list) -> Future:
        """Send a UTILITY call (thread-safe); the Future gets the core's UtilityResult once the engine thread
        reads it (the caller wakes that thread), or the dead error if the core dies first."""
        future: Future = Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        if self.dead_error is not None:
            self._calls.pop(call_id, None)
            future.set_exception(self.dead_error)
            return future
        self._send(MessageType.UTILITY, UtilityCall(call_id, self.client_index, method, args))
        return future

    def _fail_calls(self, exc: BaseException) -> None:
        for call_id in list(self._calls):
            future = self._calls.pop(call_id, None)
            if future is not None and not future.done():
                future.set_exception(exc)

    def notify(self) -> None:
        """Wake a step() waiting for outputs (called from any thread): there is a request or abort to send."""
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):  # the pipe is full (already woken) or closed (shut down)
            pass

    # -- outputs ------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.dead_error is not None:
            raise self.dead_error
        events = dict(self._poller.poll(int(STEP_POLL_S * 1000)))
        if self._wake_r in events:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        outputs = self._drain()
        if self.proc.sentinel in events:
            outputs += self._drain()  # anything it sent before dying comes first
            self._die_hard()
        return outputs

    def _drain(self) -> list[RequestOutput]:
        zmq = self._zmq
        outputs: list[RequestOutput] = []
        while True:
            try:
                frame = self._output.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return outputs
            kind, body = self._codec.decode(frame.buffer)
            if kind is MessageType.OUTPUTS:
                outputs += self._apply(body)
            elif kind is MessageType.LORA_ADAPTERS:
                self.lora_adapters = dict(body.adapters)
            elif kind is MessageType.SLEEP_STATE:
                self.sleeping = body.is_sleeping
            elif kind is MessageType.UTILITY_RESULT:
                future = self._calls.pop(body.call_id, None)
                if future is not None and not future.done():
                    future.set_result(body)
            elif kind is MessageType.DEAD:
                self.dead_error = failure_exception(body, EngineDeadError)
                logger.error("the engine core reported a fatal error: %s", body.text)
                self._fail_calls(self.dead_error)
                raise self.dead_error

    def _apply(self, core: EngineCoreOutputs) -> list[RequestOutput]:
        if core.stats is not None:
            self.stats = core.stats
        self.num_step_failures = core.num_step_failures
        tracked = self.tracker.process(core)
        if tracked.stopped_ids or tracked.aborted_ids:
            self._send(MessageType.ABORT, EngineCoreAbort(tracked.aborted_ids, tracked.stopped_ids))
        return tracked.outputs

    def _die_hard(self) -> None:
        self.proc.join(1)
        self.dead_error = EngineDeadError(
            f"the engine is dead (the engine core process died: "
            f"{self._describe_core_exit()}); this server is shutting down, "
            "retry on another replica"
        )
        logger.error("%s", self.dead_error)
        self._fail_calls(self.dead_error)
        raise self.dead_error

    def _describe_core_exit(self) -> str:
        return describe_exit(self.proc.exitcode)

    def _send(self, kind: MessageType, body) -> None:
        with self._send_lock:  # one encoder and one socket, used from two threads (call_utility)
            self._input.send(self._codec.encode(kind, body), copy=False)

    def get_stats(self) -> EngineStats | None:
        """The core's latest stats, with the waiting count raised to the requests of this server the core has
        not scheduled yet: a request in flight to the core waits as it would in an in-process scheduler, so
        --max-queue-len and vllm:num_requests_waiting see it at once, not one core step later."""
        stats = self.stats
        unscheduled = sum(
            1 for state in list(self.tracker.states.values()) if state.metrics.first_scheduled_time is None
        )
        if stats is not None and unscheduled > stats.num_requests_waiting:
            stats = dataclasses.replace(stats, num_requests_waiting=unscheduled)
        return stats

    def check_health(self) -> None:
        """Called while idle: apply what the core sent (e.g. stats after aborts) and notice its death."""
        if self.dead_error is not None:
            raise self.dead_error
        self._drain()
        if not self.proc.is_alive():
            self._drain()
            self._die_hard()

    def shutdown(self) -> None:
        """Stop the core process (idempotent): SHUTDOWN, then terminate / kill if it does not leave."""
        self._finalizer()


class PrestartedCore:
    """An engine-core process started before its config exists, so that its interpreter start and heavy
    imports (torch, transformers, the model code: core_process.PRELOAD_MODULES) run while `kvserve serve`
    still imports its own and builds the config, instead of after (issue 43: the start chain). CoreClient
    hands it the config (hand_over); cancel() stops it when no config will come. Dropped unsent, the pipe
    closes and the process leaves by itself."""

    def __init__(self):
        from kvserve.runtime.engine.core_process import run_prestarted_core

        exit_if_bootstrapping()
        mp = _core_mp_context()
        reader, self._writer = mp.Pipe(duplex=False)
        # Not a daemon: daemonic processes may not start children (the tensor-parallel workers).
        self.proc = mp.Process(
            target=run_prestarted_core,
            name="kvserve-engine-core",
            args=(reader, os.getpid(), logging.getLogger("kvserve").getEffectiveLevel()),
        )
        self.proc.start()
        reader.close()  # the child's end: once the writer closes, the child reads EOF
        self.handed_over = False

    def hand_over(self, args: tuple, kwargs: dict):
        """Send run_engine_core's arguments; the process (multiprocessing.Process) that now runs the core."""
        try:
            self._writer.send((args, kwargs))
        except OSError as exc:  # it died while importing (BrokenPipeError): say so, as a spawned core would
            self.cancel()
            raise RuntimeError(
                f"the engine core process died while starting ({describe_exit(self.proc.exitcode)}); see its log above"
            ) from exc
        self._writer.close()
        self.handed_over = True
        return self.proc

    def cancel(self, grace_s: float = 2.0) -> None:
        """No config will come: close the pipe and kill the process (it holds nothing yet: no sockets, no
        children, and it ignores SIGTERM as every core does). A no-op once handed over (CoreClient owns it)."""
        if self.handed_over:
            return
        self._writer.close()
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(grace_s)


def _core_mp_context():
    """spawn: the core is this process's own child, so its exit status is read from the core (waitpid), and
    nothing between the two can die of a signal meant for the server. A forkserver (faster starts: the core's
    imports preloaded) does not ignore SIGTERM: a SIGTERM to the process group (systemd's
    KillMode=control-group, `timeout`, supervisord's killasgroup) killed it mid-drain and the core's status,
    read through it, became 255 (issue 29). KVSERVE_CORE_START_METHOD=forkserver still selects it, for runs
    that are never stopped by a group signal (tests); api_server_group.py uses spawn for the same reason."""
    method = os.environ.get("KVSERVE_CORE_START_METHOD", "spawn")
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(
            [
                "kvserve.runtime.engine.core_process",
                "kvserve.runtime.engine.engine_core",
                "kvserve.runtime.executor.model_runner",
            ]
        )
    return ctx


def _stop_core(proc, input_sock, output_sock, ctx, tmpdir: str, fds: tuple[int, int]) -> None:
    """Never raises. Runs at shutdown(), garbage collection, or interpreter exit (before multiprocessing's
    own exit hook, which would otherwise wait forever for this non-daemon child)."""
    try:
        if proc.is_alive():
            input_sock.send(MessageType.SHUTDOWN.value, flags=0)
            proc.join(SHUTDOWN_GRACE_S)
        escalate_stop(proc)
    except Exception:  # noqa: BLE001
        pass
    close_channel((input_sock, output_sock), ctx, fds)
    shutil.rmtree(tmpdir, ignore_errors=True)


def escalate_stop(proc, grace_s: float = 2.0) -> None:
    """SIGTERM, then SIGKILL, each waited on for grace_s: for a child that did not leave when asked."""
    if proc.is_alive():
        proc.terminate()
        proc.join(grace_s)
    if proc.is_alive():
        proc.kill()
        proc.join(grace_s)


def close_channel(socks, ctx, fds) -> None:
    """Close a client's ZMQ sockets, its context and its wake-up fds. Never raises."""
    for sock in socks:
        try:
            sock.close(linger=0)
        except Exception:  # noqa: BLE001
            pass
    try:
        ctx.term()
    except Exception:  # noqa: BLE001
        pass
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass

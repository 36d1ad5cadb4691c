"""AsyncEngine: the asyncio front of the (not thread-safe) LLMEngine.

One background thread owns the engine and runs its step loop. The engine is an EngineClient (engine/client.py):
an LLMEngine (the core in this
process: torch releases the GIL during compute, so the event loop keeps serving HTTP meanwhile) or a
core_client.CoreClient (the core in its own process: this thread then only sends requests, waits on the
core's socket and detokenises). Everything else talks to that thread through a queue of
operations (add, abort) applied between steps, and gets results back on per-request asyncio queues
(`loop.call_soon_threadsafe`, one call per step for all requests).

- `await add_request(...)` returns a `RequestStream` once the engine has accepted the request; it raises the
  engine's ValueError (which names the field) when the request is invalid, before any output exists, so the
  HTTP layer can still answer 400.
- A `RequestStream` yields cumulative `RequestOutput`s. It holds at most one undelivered output (outputs are
  cumulative: a newer one replaces an older one, as vLLM's output collector merges them), so a consumer
  that stops reading -- a streaming client that does not read its socket -- costs one output, not one per
  step. Leaving the stream unfinished (client disconnect, task cancelled) aborts the request: the engine
  thread frees its KV blocks before the next step.
- Failures (runtime/errors.py): an output carrying `error` ends its stream with `RequestFailedError`
  (retryable or not); when the engine dies (`EngineDeadError`, or a tensor-parallel `WorkerDiedError`)
  every in-flight and queued request -- including adds not yet applied -- gets `EngineDeadError` at once,
  and `on_dead` is called (the server then exits non-zero once those answers are out).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable

from kvserve.runtime.engine.client import EngineClient, PromptInput
from kvserve.runtime.errors import EngineDeadError, RequestFailedError, WorkerDiedError
from kvserve.runtime.outputs import EngineStats, RequestOutput
from kvserve.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.runtime.metrics import ServerMetrics
    from kvserve.runtime.tracing import RequestTracer

__all__ = ["AsyncEngine", "EngineDeadError", "RequestFailedError", "RequestStream"]

logger = logging.getLogger(__name__)

_ABORTED = object()  # stream marker: the request was aborted by the server (drain timeout, shutdown)


# Operations the event loop queues for the engine thread, applied between steps.
@dataclass
class _AddOp:
    request_id: str
    prompt: PromptInput
    params: SamplingParams
    arrival_time: float
    stream: "RequestStream"
    accepted: asyncio.Future  # resolved (in the loop) once the engine took or refused the request
    trace_headers: dict[str, str] | None


@dataclass
class _AbortOp:
    request_id: str


class _AbortAllOp:
    pass


_Op = _AddOp | _AbortOp | _AbortAllOp


@dataclass
class _Tracked:
    """Engine-thread bookkeeping for one request (timings for the latency histograms)."""

    stream: "RequestStream"
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_tokens_seen: int = 0
    params: SamplingParams | None = None
    trace_headers: dict[str, str] | None = None  # W3C headers of the HTTP request, for the tracer


@dataclass
class RequestStream:
    request_id: str
    _engine: "AsyncEngine"
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    _latest: RequestOutput | None = None  # the newest output not yet taken by the consumer (they are cumulative)
    _end: BaseException | object | None = None  # what ends the stream after _latest: an exception or _ABORTED
    finished: bool = False
    aborted: bool = False
    last_output: RequestOutput | None = None

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while self._latest is None and self._end is None:
            self._ready.clear()
            await self._ready.wait()
        if self._latest is not None:
            item, self._latest = self._latest, None
            self.last_output = item
            if item.finished and self._end is None:
                self._done()
            return item
        end = self._end
        self._done()
        if end is _ABORTED:
            self.aborted = True
            raise StopAsyncIteration
        raise end

    def _put(self, item: RequestOutput | BaseException | object) -> None:
        """Event-loop side delivery: an output replaces any undelivered one; an end is kept once."""
        if isinstance(item, BaseException) or item is _ABORTED:
            if self._end is None:
                self._end = item
        elif self._end is None:
            self._latest = item
        self._ready.set()

    def _done(self) -> None:
        self.finished = True
        self._engine._active.discard(self.request_id)

    def abort(self) -> None:
        """Abort unless finished; safe to call more than once and from finally blocks."""
        if not self.finished:
            self._done()
            self._engine.abort(self.request_id)


class AsyncEngine:
    def __init__(
        self,
        engine: EngineClient,
        metrics: ServerMetrics | None = None,
        *,
        log_interval_s: float,  # ServerConfig.log_interval_s (the server's setting, no second default here)
        tracer: RequestTracer | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
    ):
        self.engine = engine
        self.metrics = metrics
        self.tracer = tracer  # runtime.tracing.RequestTracer, or None (tracing off)
        self.on_dead = on_dead  # called in the event loop once every request got the engine's death
        self.log_interval_s = log_interval_s
        self._ops: queue.SimpleQueue[_Op] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._active: set[str] = set()  # event-loop side: requests whose stream is not finished
        self._pending_adds = 0
        self._pending_lock = threading.Lock()
        self.stats: EngineStats | None = None
        self.dead_error: BaseException | None = None
        self._dead_lock = threading.Lock()  # orders "add queued" against "engine died, queue drained"
        self.num_step_failures = 0

    # ---- lifecycle -----------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._refresh_stats()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        if self.tracer is not None:
            self.tracer.shutdown()

    def _wake(self) -> None:
        self._wakeup.set()
        self.engine.notify()  # CoreClient: interrupt its wait for the core's outputs

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    # ---- event-loop API ------------------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        """Requests accepted and not yet finished (what a drain waits for)."""
        return len(self._active)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for their first schedule, including adds not yet applied by the engine thread."""
        waiting = self.stats.num_requests_waiting if self.stats is not None else 0
        return waiting + self._pending_adds

    async def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        arrival_time: float | None = None,
        trace_headers: dict[str, str] | None = None,
    ) -> RequestStream:
        if request_id in self._active:
            raise ValueError(f"duplicate request id {request_id!r}")
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future = loop.create_future()
        stream = RequestStream(request_id, self)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        with self._dead_lock:  # once the engine is dead nothing is queued that nobody would answer
            if not self.is_running:
                raise _dead_error_for_clients(self.dead_error)
            with self._pending_lock:
                self._pending_adds += 1
            self._active.add(request_id)
            self._ops.put(_AddOp(request_id, prompt, params, arrival, stream, accepted, trace_headers))
        self._wake()
        try:
            await accepted
        except BaseException:
            rejected = accepted.done() and not accepted.cancelled() and accepted.exception() is not None
            if rejected:  # the engine never took it
                stream._done()
            else:  # our caller was cancelled while waiting: make sure nothing lingers in the engine
                stream.abort()
            raise
        if self.metrics is not None:
            self.metrics.observe_request_start(params.n, params.max_tokens)
        return stream

    async def generate(
        self, request_id: str, prompt: PromptInput, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Convenience: add, then yield outputs; aborts the request if the caller stops early."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        self._active.discard(request_id)
        self._ops.put(_AbortOp(request_id))
        self._wake()

    def abort_all(self) -> None:
        self._ops.put(_AbortAllOp())
        self._wake()

    # ---- engine thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        last_log = time.monotonic()
        last_logged_counters: tuple = ()
        deliveries: list[tuple[RequestStream, RequestOutput | BaseException | object]] = []
        try:
            while not self._stop.is_set():
                deliveries = []
                self._apply_ops(deliveries)
                if self.engine.has_unfinished_requests():
                    self._step(deliveries)
                else:
                    self._check_engine_health()  # a dead tensor-parallel worker stops the loop even when idle
                    self._refresh_stats()
                    self._flush(deliveries)
                    deliveries = []
                    if self._ops.empty():
                        self._wakeup.wait(timeout=min(0.5, self.log_interval_s))
                        self._wakeup.clear()
                self._flush(deliveries)
                now = time.monotonic()
                if now - last_log >= self.log_interval_s:
                    last_logged_counters = self._log_stats(now - last_log, last_logged_counters)
                    last_log = now
        except (EngineDeadError, WorkerDiedError) as exc:
            logger.error("engine dead, /health now reports engine_dead: %s", exc)
            self._flush(deliveries)  # e.g. abort markers of this turn: those streams are no longer tracked
            self._die(exc)
        except BaseException as exc:  # a bug in this loop; fail everyone loudly
            logger.exception("engine loop died")
            self._flush(deliveries)
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        """Answer every in-flight and queued request (and adds not yet applied) with EngineDeadError, then
        tell the server (on_dead), which exits non-zero once the answers are out."""
        error = _dead_error_for_clients(exc)
        with self._dead_lock:
            self.dead_error = exc
            pending = []
            while True:
                try:
                    pending.append(self._ops.get_nowait())
                except queue.Empty:
                    break
        for op in pending:
            if isinstance(op, _AddOp):
                with self._pending_lock:
                    self._pending_adds -= 1
                self._resolve(op.accepted, error)
        self._fail_all(error)
        if self.metrics is not None:
            self.metrics.set_engine_alive(False)
        if self.on_dead is not None:
            self._call_in_loop(self.on_dead, exc)

    def _apply_ops(self, deliveries: list) -> None:
        while True:
            try:
                op = self._ops.get_nowait()
            except queue.Empty:
                return
            if isinstance(op, _AddOp):
                with self._pending_lock:
                    self._pending_adds -= 1
                if op.stream.finished:  # aborted before it reached the engine
                    continue
                try:
                    self.engine.add_request(op.request_id, op.prompt, op.params, arrival_time=op.arrival_time)
                except Exception as exc:  # invalid request: the engine named the field
                    self._resolve(op.accepted, exc)
                    continue
                self._tracked[op.request_id] = _Tracked(
                    op.stream, op.arrival_time, params=op.params, trace_headers=op.trace_headers
                )
                self._resolve(op.accepted, None)
            elif isinstance(op, _AbortOp):
                self._abort_in_engine(op.request_id)
            else:  # _AbortAllOp
                for request_id in list(self._tracked):
                    deliveries.append((self._tracked[request_id].stream, _ABORTED))
                    self._abort_in_engine(request_id)

    def _abort_in_engine(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)
        try:
            self.engine.abort_request(request_id)
        except Exception:
            logger.exception("abort_request(%s) failed", request_id)

    def _check_engine_health(self) -> None:
        self.engine.check_health()  # raises WorkerDiedError: _run marks the engine dead (/health turns 503)

    def _step(self, deliveries: list) -> None:
        try:
            outputs = self.engine.step()  # raises only when the engine is dead (_run answers everyone)
        finally:
            self._count_step_failures()
        now = time.monotonic()
        metrics = self.metrics
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:  # aborted meanwhile
                continue
            num_tokens = sum(len(c.token_ids) for c in output.outputs)
            if num_tokens > tracked.num_tokens_seen:
                if tracked.first_token_time is None:
                    tracked.first_token_time = now
                    if metrics is not None:
                        metrics.time_to_first_token.observe(now - tracked.arrival_time)
                elif metrics is not None:
                    metrics.inter_token_latency.observe(now - tracked.last_token_time)
                tracked.last_token_time = now
                tracked.num_tokens_seen = num_tokens
            if output.finished:
                del self._tracked[output.request_id]
                if output.error is not None:  # the engine failed it (and freed it)
                    deliveries.append((tracked.stream, RequestFailedError.from_error(output.error)))
                    if metrics is not None:
                        metrics.observe_failed()
                    continue
                if metrics is not None or self.tracer is not None:
                    self._observe_finished(output, tracked, now)
            deliveries.append((tracked.stream, output))  # the engine builds fresh outputs each step
        self._refresh_stats()

    def _count_step_failures(self) -> None:
        failures = self.engine.num_step_failures
        if failures > self.num_step_failures:
            if self.metrics is not None:
                self.metrics.engine_step_failures.inc(failures - self.num_step_failures)
            self.num_step_failures = failures

    def _observe_finished(self, output: RequestOutput, tracked: _Tracked, now: float) -> None:
        first_scheduled = output.metrics.first_scheduled_time
        reasons = [c.finish_reason for c in output.outputs if c.finish_reason]
        timings = dict(
            num_prompt_tokens=len(output.prompt_token_ids or []),
            num_generation_tokens=tracked.num_tokens_seen,
            arrival_time=tracked.arrival_time,
            first_scheduled_time=first_scheduled,
            first_token_time=tracked.first_token_time,
            finished_time=now,
        )
        if self.metrics is not None:
            self.metrics.observe_finished(finish_reason=reasons[0] if reasons else "stop", **timings)
        if self.tracer is not None:
            try:
                self.tracer.record_finished(
                    request_id=output.request_id, trace_headers=tracked.trace_headers, params=tracked.params, **timings
                )
            except Exception:  # tracing is best effort; it never costs a request
                logger.exception("recording the trace of %s failed", output.request_id)

    def _refresh_stats(self) -> None:
        try:
            self.stats = self.engine.get_stats()
        except Exception:  # stats are best effort; never let them stop the loop
            logger.exception("get_stats failed")
            return
        if self.metrics is not None:
            self.metrics.update_from_stats(self.stats)

    def _log_stats(self, interval_s: float, last: tuple) -> tuple:
        s = self.stats
        if s is None:
            return last
        counters = (s.prompt_tokens, s.generation_tokens, s.prefix_cache_queries, s.prefix_cache_hits)
        if last and counters == last and s.num_requests_running == 0 and s.num_requests_waiting == 0:
            return counters  # idle: say nothing
        prev = last or (0, 0, 0, 0)
        queries = counters[2] - prev[2]
        hit_rate = (counters[3] - prev[3]) / queries * 100 if queries else 0.0
        logger.info(
            "running=%d waiting=%d kv_cache_usage=%.1f%% prompt_throughput=%.1f tok/s "
            "generation_throughput=%.1f tok/s prefix_cache_hit_rate=%.1f%% preemptions=%d",
            s.num_requests_running,
            s.num_requests_waiting,
            s.kv_cache_usage * 100,
            (counters[0] - prev[0]) / interval_s,
            (counters[1] - prev[1]) / interval_s,
            hit_rate,
            s.num_preemptions,
        )
        return counters

    def _resolve(self, future: asyncio.Future, exc: BaseException | None) -> None:
        def apply() -> None:
            if future.done():
                return
            if exc is None:
                future.set_result(None)
            else:
                future.set_exception(exc)

        self._call_in_loop(apply)

    def _flush(self, deliveries: list) -> None:
        if deliveries:
            self._call_in_loop(_deliver, deliveries)

    def _fail_all(self, error: BaseException) -> None:
        deliveries = [(t.stream, error) for t in self._tracked.values()]
        if self.metrics is not None:
            for _ in deliveries:
                self.metrics.observe_failed()
        self._tracked.clear()
        self._flush(deliveries)

    def _call_in_loop(self, fn: Callable[..., None], *args: object) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed during shutdown
            pass


def _deliver(deliveries: list) -> None:
    for stream, item in deliveries:
        stream._put(item)


def _dead_error_for_clients(exc: BaseException | None) -> EngineDeadError:
    """What clients see when the engine is dead: no Python repr, no pids (the log has the details)."""
    if isinstance(exc, EngineDeadError):
        return exc
    cause = (
        "a tensor-parallel worker died"
        if isinstance(exc, WorkerDiedError)
        else "the engine stopped"
        if exc is None
        else "the engine loop failed"
    )
    return EngineDeadError(f"the engine is dead ({cause}); this server is shutting down, retry on another replica")

"""The engine-core side of the LoRA registry calls (runtime/server/lora_remote.py has the API server's side): a
UTILITY message runs on one utility thread beside core_process.py's step loop -- reading an adapter's files
never stalls a step -- and its UTILITY_RESULT goes back to the calling API server from the loop thread
(which owns the sockets). After a load or unload every API server first gets LORA_ADAPTERS (the new
name -> directory map), then the caller its result, on the same socket, so the caller's view is current
when it answers."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvserve.runtime.engine import sleep_control
from kvserve.runtime.engine.core_messages import LoraAdapters, MessageType, SleepState, UtilityCall, UtilityResult
from kvserve.runtime.lora.errors import LoraRequestError

logger = logging.getLogger("kvserve.lora")

UTILITY_POLL_MS = 5  # how often the core's loop looks for a finished call while one runs
_CHANGES_REGISTRY = ("load_lora_adapter", "unload_lora_adapter")
_CHANGES_SLEEP = ("sleep", "wake_up")


def run_utility(core: Any, method: str, args: list) -> dict[str, str]:
    """Run one registry call against an EngineCore (any thread but the step loop's). LoraRequestError when
    refused. Every call returns the served adapters afterwards (name -> directory); the sleep-mode calls
    (engine/sleep_control.py) return their own answers."""
    if method in sleep_control.CALLS:
        return sleep_control.run(core, method, args)
    registry = core.lora_registry
    if registry is None:
        raise LoraRequestError(404, None, "lora_disabled", "LoRA is off: start the server with --enable-lora")
    if method == "load_lora_adapter":
        name, path, load_inplace = (list(args) + [False])[:3]
        served = registry.load(name, path, bool(load_inplace))
        logger.info("loaded LoRA adapter %r from %s", name, path)
        return served
    if method == "unload_lora_adapter":
        served = registry.unload(args[0])
        logger.info("unloaded LoRA adapter %r", args[0])
        return served
    if method == "list_lora_adapters":
        return registry.adapters()
    raise LoraRequestError(400, None, "unknown_call", f"unknown engine-core call {method!r}")


def _result(call_id: int, future: Future) -> UtilityResult:
    exc = future.exception()
    if exc is None:
        return UtilityResult(call_id, value=future.result())
    if isinstance(exc, LoraRequestError | sleep_control.SleepModeError):
        return UtilityResult(call_id, exc.status, exc.message, exc.param, exc.code)
    logger.error("engine-core call failed", exc_info=exc)
    return UtilityResult(call_id, 500, f"{type(exc).__name__}: {exc}", None, "internal_error")


class CoreUtilities:
    """The engine core's utility thread and the calls running on it (core_process.py's loop owns this)."""

    def __init__(self, core: Any):
        self.core = core
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-core-utility")
        self._running: list[tuple[Future, UtilityCall]] = []

    def submit(self, call: UtilityCall) -> None:
        self._running.append((self._pool.submit(run_utility, self.core, call.method, call.args), call))

    def poll_ms(self, idle_ms: int) -> int:
        """The loop's idle wait: short while a call runs, so its result leaves as soon as it is done."""
        return UTILITY_POLL_MS if self._running else idle_ms

    def send_finished(self, outs: list, codec: Any) -> None:
        if not self._running or not any(f.done() for f, _ in self._running):
            return
        done = [(f, c) for f, c in self._running if f.done()]
        self._running = [(f, c) for f, c in self._running if not f.done()]
        for future, call in done:
            result = _result(call.call_id, future)
            if result.status == 0 and call.method in _CHANGES_REGISTRY:
                frame = codec.encode(MessageType.LORA_ADAPTERS, LoraAdapters(sorted(result.value.items())))
                for sock in outs:
                    sock.send(frame, copy=False)
            if result.status == 0 and call.method in _CHANGES_SLEEP:  # every API server, before the caller's result
                frame = codec.encode(MessageType.SLEEP_STATE, SleepState(bool(result.value["is_sleeping"])))
                for sock in outs:
                    sock.send(frame, copy=False)
            if 0 <= call.client_index < len(outs):
                outs[call.client_index].send(codec.encode(MessageType.UTILITY_RESULT, result), copy=False)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

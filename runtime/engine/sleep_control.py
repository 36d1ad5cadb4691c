"""The engine core's side of sleep mode (--enable-sleep-mode; the API server's routes are server/sleep_routes.py).

The calls arrive as UTILITY calls (engine/core_utilities.py) on the core's utility thread, beside the step loop,
so they must never overlap a step: sleep is refused (409) while any request is unfinished -- the API server
first stops taking requests and waits for those in flight -- and once `core.sleep_level` is set, add_request
refuses new ones (`sleep_guard` makes the check and the set one step for both threads). Wake restores every
rank (executor/sleep_mode.py) and resets the prefix cache: its blocks' KV was freed.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvserve.runtime.config import SLEEP_LEVELS

logger = logging.getLogger("kvserve.sleep")

CALLS = ("sleep", "wake_up", "is_sleeping")


class SleepModeError(Exception):
    """A sleep-mode call refused: the HTTP status, the request field to blame, an OpenAI-style code."""

    def __init__(self, status: int, param: str | None, code: str, message: str):
        super().__init__(message)
        self.status, self.param, self.code, self.message = status, param, code, message


def run(core: Any, method: str, args: list) -> Any:
    if method == "is_sleeping":
        return {"is_sleeping": bool(core.sleep_level)}
    if not core.config.enable_sleep_mode:
        raise SleepModeError(400, None, "sleep_mode_disabled", "sleep mode is off: start with --enable-sleep-mode")
    if method == "sleep":
        return sleep(core, args[0] if args else 1)
    return wake_up(core)


def sleep(core: Any, level: Any) -> dict:
    if level not in SLEEP_LEVELS:
        raise SleepModeError(400, "level", "invalid_level", f"level must be 1 or 2, got {level!r}")
    if level == 2 and core.lora_registry is not None:
        raise SleepModeError(
            400, "level", "invalid_level", "level 2 re-reads the weights, which would drop the LoRA adapters"
        )
    with core.sleep_guard:
        if core.sleep_level:
            return {"is_sleeping": True}
        if core.has_unfinished_requests():
            raise SleepModeError(409, None, "requests_in_flight", "requests are in flight: sleep once they finish")
        core.sleep_level = level
    started = time.monotonic()
    try:
        core.executor.sleep(level)
    except BaseException:
        core.sleep_level = 0
        raise
    logger.info("engine asleep (level %d) in %.2f s", level, time.monotonic() - started)
    return {"is_sleeping": True, "seconds": time.monotonic() - started}


def wake_up(core: Any) -> dict:
    if not core.sleep_level:
        return {"is_sleeping": False}
    started = time.monotonic()
    level = core.sleep_level
    core.executor.wake_up()
    core.kv_cache_manager.pool.reset_prefix_cache()  # no request holds a block: always succeeds here
    core.sleep_level = 0
    logger.info("engine awake (from level %d) in %.2f s", level, time.monotonic() - started)
    return {"is_sleeping": False, "seconds": time.monotonic() - started}

"""vLLM's sleep-mode routes (with --enable-sleep-mode; without it they answer 404 like an absent route, as in
vLLM, where they exist only when enabled): `POST /sleep?level=1|2` (empty 200), `POST /wake_up` (empty 200),
`GET /is_sleeping` (`{"is_sleeping": bool}`).

Readiness (/health, /ready) answers 503 `{"status": "sleeping"}` and every request that needs the model gets
503 with Retry-After (the middleware below) from the moment /sleep arrives here (`state.sleeping`, this
server's sleep under way), so a router or Service stops sending here; the requests already in flight finish,
then the engine core frees its memory (engine/sleep_control.py, which refuses while any request is unfinished).
From then on the core's own state decides (`state.asleep`): after every sleep and wake_up the core sends
SLEEP_STATE to every API server before the caller's answer, so with --api-server-count > 1 all of them answer
not ready and refuse while it sleeps, and all serve again after a /wake_up sent to any one of them (an idle
server reads it within its idle poll, 0.5 s). While a /sleep waits for the requests in flight, the other API
servers still admit requests; the wait covers theirs too (SETTLE_TIMEOUT_S).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvserve.runtime.engine.core_messages import UtilityResult
from kvserve.runtime.engine.core_utilities import run_utility
from kvserve.runtime.engine.sleep_control import SleepModeError
from kvserve.runtime.server.errors import APIError, error_response

RETRY_AFTER_S = 5  # what a request refused while asleep is told (a wake takes about a second at level 1)
SETTLE_TIMEOUT_S = 60.0  # how long /sleep waits for the requests in flight to finish
SETTLE_POLL_S = 0.02
CALL_TIMEOUT_S = 600.0  # a level-2 wake re-reads the checkpoint
# The routes that need the model (vLLM's protected endpoints); /v1/models, /tokenize, /detokenize, /metrics keep
# answering while asleep, as in vLLM. LoRA loads are refused too: they write into the model's adapter slots.
GATED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"})

_local_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-sleep")


async def _call(state: Any, method: str, *args: Any) -> Any:
    """One engine-core call (the core's process, or the in-process core on a pool thread); APIError if refused."""
    from kvserve.runtime.engine.core_client import CoreClient

    client = state.engine.engine  # AsyncEngine -> its EngineClient
    try:
        if not isinstance(client, CoreClient):
            return await asyncio.get_running_loop().run_in_executor(
                _local_pool, run_utility, client.core, method, list(args)
            )
        future = client.call_utility(method, list(args))
        state.engine._wake()  # the engine thread reads the answer: have it look now
        result: UtilityResult = await asyncio.wait_for(asyncio.wrap_future(future), CALL_TIMEOUT_S)
    except SleepModeError as exc:
        raise APIError(exc.status, exc.message, param=exc.param, code=exc.code) from None
    except asyncio.TimeoutError:
        raise APIError(504, f"the engine core did not answer {method} in time", code="timeout") from None
    if result.status:
        raise APIError(result.status, result.message, param=result.param, code=result.code)
    return result.value


def _engine(state: Any, request: Request) -> Any:
    """The running engine, after the checks every sleep route makes: 404 without --enable-sleep-mode (the flag
    is the engine's, known once it loaded), 503 while it loads or after it died."""
    if state.engine is None or not state.engine.is_running:
        raise APIError(503, "the model is not loaded", type="server_error", code="service_unavailable")
    if not state.engine.engine.config.enable_sleep_mode:
        raise APIError(404, f"Not Found: {request.method} {request.url.path}", type="not_found_error")
    return state.engine


def add_routes(app: FastAPI, state: Any, serving: Any) -> None:
    app.add_middleware(_RefuseWhileAsleep, state=state)

    @app.post("/sleep")
    async def sleep(request: Request) -> Response:
        serving.check_auth(request)
        engine = _engine(state, request)
        raw = request.query_params.get("level", "1")
        if raw not in ("1", "2"):
            raise APIError(400, f"level must be 1 or 2, got {raw!r}", param="level")
        state.sleeping = True  # readiness 503 and new requests refused from here on
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        try:
            while True:
                try:
                    await _call(state, "sleep", int(raw))  # the core's SLEEP_STATE arrived before its answer
                    break
                except APIError as exc:  # requests still in flight: wait for them
                    if exc.status != 409 or time.monotonic() > deadline or not engine.is_running:
                        raise
                await asyncio.sleep(SETTLE_POLL_S)
        finally:
            state.sleeping = False  # the engine's reported state (state.asleep) holds from here
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(request: Request) -> Response:
        serving.check_auth(request)
        _engine(state, request)
        await _call(state, "wake_up")
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping(request: Request) -> JSONResponse:
        serving.check_auth(request)
        _engine(state, request)
        value = await _call(state, "is_sleeping")
        return JSONResponse({"is_sleeping": bool(value["is_sleeping"])})


class _RefuseWhileAsleep:
    """Pure ASGI middleware: while asleep, requests that need the model get 503 + Retry-After before any parsing."""

    def __init__(self, app: Any, state: Any):
        self.app, self.state = app, state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] in GATED_PATHS and self.state.asleep:
            response = error_response(
                503,
                "The server is asleep (sleep mode); retry shortly or POST /wake_up.",
                type="server_error",
                code="service_unavailable",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
            return await response(scope, receive, send)
        await self.app(scope, receive, send)

"""The FastAPI app: OpenAI-compatible completions and chat completions (streaming or not), /v1/models,
/health, /metrics, /tokenize, /detokenize, and vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter.

Routes and wiring; the handling itself is in completions.py and chat.py over OpenAIServing (serving.py).

Request path: auth -> drain/ready check -> parse + validate (400 naming the field) -> model name (404) ->
queue depth (429 + Retry-After) -> tokenize off the event loop -> AsyncEngine.add_request (the engine's
own validation maps to 400) -> stream SSE chunks or collect. A client that goes away aborts its requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.runtime.lora.errors import LoraRequestError
from kvserve.runtime.metrics import CONTENT_TYPE
from kvserve.runtime.server import chat as chat_endpoint
from kvserve.runtime.server import completions as completions_endpoint
from kvserve.runtime.server import lora_remote, lora_routes, sleep_routes
from kvserve.runtime.server.errors import APIError, error_response
from kvserve.runtime.server.serving import OpenAIServing
from kvserve.runtime.server.state import ServerConfig, ServerState

logger = logging.getLogger("kvserve.server")


def build_app(config: ServerConfig, *, engine: Any = None, engine_factory: Callable[[], Any] | None = None) -> FastAPI:
    """`engine`: an LLMEngine already loaded (tests). `engine_factory`: called in a worker thread at startup
    while /health says 503 (the server binds first, so a Kubernetes startup probe sees it loading)."""
    state = ServerState(config)

    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        load_task = None
        owned: list[Any] = []  # engines this app built (their processes end with it); a passed-in one is the caller's
        if engine is not None:
            state.attach_engine(engine)
        elif engine_factory is not None:

            async def load() -> None:
                try:
                    loaded = await asyncio.get_running_loop().run_in_executor(None, engine_factory)
                    owned.append(loaded)
                    state.attach_engine(loaded)
                except asyncio.CancelledError:
                    # A stop (SIGTERM) while the model was still loading: nothing was accepted, so nothing is
                    # lost; the server exits 0 like any finished drain, not as a failed start-up.
                    logger.info("stopped while the model was loading")
                    raise
                except BaseException as exc:
                    state.load_error = exc
                    logger.exception("model loading failed")
                    if state.on_fatal is not None:
                        state.on_fatal(exc)

            load_task = asyncio.create_task(load())
        try:
            yield
        finally:
            if load_task is not None and not load_task.done():
                load_task.cancel()
            if state.engine is not None:
                state.engine.shutdown()
            for built in owned:
                built.shutdown()  # the engine-core process, tensor-parallel workers
            state.tokenize_pool.shutdown(wait=False, cancel_futures=True)
            state.grammar_pool.shutdown(wait=False, cancel_futures=True)
            state.parse_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kvserve", lifespan=lifespan)
    app.state.kvserve = state
    serving = OpenAIServing(state)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if state.metrics is not None and exc.status in (401, 429, 503):
            state.metrics.reject({401: "unauthorized", 429: "queue_full", 503: "unavailable"}[exc.status])
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, f"{message}: {request.method} {request.url.path}", type=kind)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}", type="server_error")

    @app.get("/health")
    async def health() -> Response:
        if state.ready and state.group_ready:
            return JSONResponse({"status": "ok"})
        status = (
            "draining"
            if state.stopping or state.draining
            else "sleeping"
            if state.asleep
            else "failed"
            if state.load_error is not None
            else "loading"
            if state.engine is None or state.ready  # ready here, another API server of the group is not yet
            else "engine_dead"
        )
        return JSONResponse({"status": status}, status_code=503)

    # /ready is the readiness probe's name for the same answer as /health (200 only while requests are
    # served); /health keeps its name for existing probes. Liveness should use a TCP probe (docs/serving.md).
    app.add_api_route("/ready", health, methods=["GET"])

    @app.get("/metrics")
    async def metrics() -> Response:
        body = state.metrics.render() if state.metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        serving.check_auth(request)
        # Honest readiness (issue 26): a client or gateway probing /v1/models must not see 200 while the
        # model loads (its next request would get 503); every API route answers the same OpenAI-style 503.
        serving.check_ready()
        data = []
        for name in config.served_model_names:
            entry = {
                "id": name,
                "object": "model",
                "created": state.created,
                "owned_by": "kvserve",
                "root": config.model_dir,
                "parent": None,
                "max_model_len": state.max_model_len or None,
                "random_weights": config.random_weights,
                "vocab_size": state.vocab_size or None,
            }
            if config.random_weights:
                entry["description"] = (
                    "kvserve built-in demo model with RANDOM WEIGHTS: it exercises the serving "
                    "path; its output is gibberish"
                )
            data.append(entry)
        adapters = {}
        if state.lora_enabled:  # the engine core's registry: adapters loaded through any API server of a group
            try:
                adapters = await lora_remote.call(state, "list_lora_adapters")
            except LoraRequestError:
                adapters = lora_remote.served_adapters(state)
        for name, path in adapters.items():  # as vLLM lists them: the base model is the parent
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "kvserve",
                    "root": path,
                    "parent": config.served_model_names[0],
                    "max_model_len": state.max_model_len or None,
                }
            )
        return JSONResponse({"object": "list", "data": data})

    lora_routes.add_routes(app, state, serving)  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    sleep_routes.add_routes(app, state, serving)  # /sleep, /wake_up, /is_sleeping (404 without the flag)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await completions_endpoint.create_completion(serving, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await chat_endpoint.create_chat_completion(serving, request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        return await serving.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        return await serving.detokenize(request)

    if config.api_server_count > 1:  # added last: the outermost middleware, so every answer carries it
        app.add_middleware(_ServerIndexHeader, index=config.api_server_index)
    return app


# ------------------------------------------------------------------------------------------------------


class _ServerIndexHeader:
    """Pure ASGI middleware: `x-kvserve-api-server: <index>` on every response, so a client (or a test) can
    tell which API server of the group answered."""

    def __init__(self, app: Any, index: int):
        self.app, self.header = app, (b"x-kvserve-api-server", str(index).encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header)

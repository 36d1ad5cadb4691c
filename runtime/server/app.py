"""The FastAPI app: OpenAI-compatible completions and chat completions (streaming or not), /v1/models,
/health, /metrics, /tokenize, /detokenize.

Routes and wiring; the handling itself is OpenAIServing in serving.py.

Request path: auth -> drain/ready check -> parse + validate (400 naming the field) -> model name (404) ->
queue depth (429 + Retry-After) -> tokenize off the event loop -> AsyncEngine.add_request (the engine's
own validation maps to 400) -> stream SSE chunks or collect. A client that goes away aborts its requests.
"""
from __future__ import annotations

import asyncio
import copy
import gc
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.runtime.engine.async_engine import AsyncEngine
from kvserve.runtime.metrics import CONTENT_TYPE, ServerMetrics
from kvserve.runtime.server.errors import APIError, error_response
from kvserve.runtime.server.serving import OpenAIServing
from kvserve.runtime.tracing import build_otlp_tracer
from kvserve.runtime.worker import kv_sizing

logger = logging.getLogger("kvserve.server")

# Used when the model ships no chat template (base models such as stories260K): role-prefixed turns.
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token if bos_token else '' }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% else %}{{ message['role'] | capitalize }}: {{ message['content'] + '\n\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


@dataclass
class ServerConfig:
    served_model_names: list[str]
    model_dir: str = ""
    api_key: str | None = None
    max_queue_len: int | None = None  # 429 when this many requests already wait
    drain_timeout_s: float = 30.0
    random_weights: bool = False
    max_request_body_bytes: int = 32 * 1024 * 1024  # larger bodies get 413 (--max-request-body-bytes)
    retry_after_s: int = 1
    log_interval_s: float = 5.0
    tool_call_parser: str | None = None  # hermes | llama3_json: parse tool calls for tool_choice "auto"
    otlp_traces_endpoint: str | None = None  # OpenTelemetry request spans go here (None: tracing off)
    request_tracer: Any = None  # a ready runtime.tracing.RequestTracer (tests); wins over the endpoint
    # --api-server-count N: this is API server `api_server_index` of N sharing one engine core
    # (runtime/server/api_server_group.py): group-wide metrics, and an x-kvserve-api-server response header.
    api_server_index: int = 0
    api_server_count: int = 1


@dataclass
class ServerState:
    config: ServerConfig
    engine: AsyncEngine | None = None
    tokenizer: Any = None
    metrics: ServerMetrics | None = None
    max_model_len: int = 0
    vocab_size: int = 0
    limits: Any = None  # the engine's sampling_params.RequestLimits: what a request is validated against
    max_token_chars: int = 64
    chat_template: str | None = None
    draining: bool = False
    load_error: BaseException | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    on_fatal: Callable[[BaseException], None] | None = None  # loading failed: exit non-zero
    on_engine_dead: Callable[[BaseException], None] | None = None  # every request answered; exit non-zero
    # One worker: HF tokenizers mutate internal state on encode, so never use one from two threads at once.
    tokenize_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-tokenize"))
    # Grammars compile here, beside the event loop and off the engine's step (runtime/structured_output).
    grammar_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-grammar"))
    grammar_compiler: Any = None
    # Large request bodies are parsed here, not on the event loop.
    parse_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvserve-parse"))

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.is_running and not self.draining

    def attach_engine(self, llm_engine: Any) -> None:
        """Wire up a loaded LLMEngine: tokenizer copy for the HTTP side, metrics, the async loop."""
        model_config = llm_engine.config.model
        self.max_model_len = int(model_config.max_model_len)
        try:
            self.tokenizer = copy.deepcopy(llm_engine.tokenizer)  # the engine thread keeps its own
        except Exception:  # pragma: no cover - tokenizers that cannot be copied: share, guarded by one thread
            self.tokenizer = llm_engine.tokenizer
        self.vocab_size = len(self.tokenizer)
        self.grammar_compiler = _GrammarCompilerFactory(self.tokenizer, model_config)
        self.limits = llm_engine.limits
        vocab = self.tokenizer.get_vocab()
        self.max_token_chars = max((len(t) for t in vocab), default=64) or 64
        self.chat_template = getattr(self.tokenizer, "chat_template", None) or FALLBACK_CHAT_TEMPLATE
        cache = llm_engine.config.cache
        cache_info = {k: getattr(cache, k) for k in ("block_size", "num_blocks", "enable_prefix_caching",
                                                     "kv_cache_dtype", "gpu_memory_utilization") if hasattr(cache, k)}
        if "num_blocks" in cache_info:
            cache_info["num_gpu_blocks"] = cache_info["num_blocks"]  # vLLM's label name (null block included)
        # Sliding-window models keep one block table per KV cache group over the one pool (capacity.py).
        num_groups = kv_sizing.layout(llm_engine.config).num_groups
        if self.config.api_server_count > 1:
            from kvserve.runtime.metrics_group import GroupServerMetrics

            self.metrics = GroupServerMetrics(self.config.api_server_index, self.config.served_model_names[0],
                                              self.max_model_len, cache_info, num_groups)
        else:
            self.metrics = ServerMetrics(self.config.served_model_names[0], self.max_model_len, cache_info, num_groups)
        self.metrics.track_health(lambda: self.ready)
        tracer = self.config.request_tracer
        if tracer is None and self.config.otlp_traces_endpoint:
            tracer = build_otlp_tracer(self.config.otlp_traces_endpoint, self.config.served_model_names[0])
        self.engine = AsyncEngine(llm_engine, self.metrics, log_interval_s=self.config.log_interval_s,
                                  tracer=tracer, on_dead=self._engine_died)
        self.engine.start()
        _freeze_startup_heap()
        logger.info("ready: model=%s max_model_len=%d kv_blocks=%s%s", self.config.served_model_names[0],
                    self.max_model_len, cache_info.get("num_blocks"),
                    " (RANDOM WEIGHTS: output is gibberish)" if self.config.random_weights else "")


    def _engine_died(self, exc: BaseException) -> None:
        if self.on_engine_dead is not None:
            self.on_engine_dead(exc)


def _freeze_startup_heap() -> None:
    """Move everything alive after start-up (the tokenizer and its vocabulary, pydantic and FastAPI models,
    imported modules: ~320k objects in the demo-model server) out of the collector's reach. Streaming makes
    many short-lived objects per token, so full collections keep coming, and each one traversed that whole
    heap holding the GIL: 0.2-0.3 s per collection, twice in a 13 s run of 256 streams (both the event loop
    and the engine thread stall meanwhile). Objects still die by reference counting as before; only cycles
    among the frozen ones are never collected. vLLM's API server does the same (gc.collect(); gc.freeze())."""
    gc.collect()
    gc.freeze()


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
    if config.api_server_count > 1:
        app.add_middleware(_ServerIndexHeader, index=config.api_server_index)
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
        if state.ready:
            return JSONResponse({"status": "ok"})
        status = ("draining" if state.draining else "failed" if state.load_error is not None
                  else "loading" if state.engine is None else "engine_dead")
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        body = state.metrics.render() if state.metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        serving.check_auth(request)
        data = []
        for name in config.served_model_names:
            entry = {"id": name, "object": "model", "created": state.created, "owned_by": "kvserve",
                     "root": config.model_dir, "parent": None, "max_model_len": state.max_model_len or None,
                     "random_weights": config.random_weights, "vocab_size": state.vocab_size or None}
            if config.random_weights:
                entry["description"] = ("kvserve built-in demo model with RANDOM WEIGHTS: it exercises the serving "
                                        "path; its output is gibberish")
            data.append(entry)
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.chat_completions(request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        return await serving.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        return await serving.detokenize(request)

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


class _GrammarCompilerFactory:
    """Builds the xgrammar compiler on first use (most servers never see a structured request)."""

    def __init__(self, tokenizer: Any, model_config: Any):
        self.tokenizer, self.model_config, self._compiler = tokenizer, model_config, None

    def compile(self, spec: Any) -> Any:
        if self._compiler is None:
            from kvserve.runtime.structured_output.compiler import GrammarCompiler

            m = self.model_config
            self._compiler = GrammarCompiler(self.tokenizer, m.model_dir, m.vocab_size, m.eos_token_ids)
        return self._compiler.compile(spec)

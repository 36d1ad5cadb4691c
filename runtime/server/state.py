"""What one API server process holds: its settings (ServerConfig, from server_config.py) and its state
(ServerState: the attached engine, the HTTP side's tokenizer copy, metrics, the thread pools for tokenising,
grammar compilation and body parsing). The app (app.py) wires routes to it; OpenAIServing (serving.py) handles
requests with it."""

from __future__ import annotations

import copy
import gc
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from kvserve.runtime.engine.async_engine import AsyncEngine
from kvserve.runtime.engine.client import EngineClient
from kvserve.runtime.executor import kv_sizing
from kvserve.runtime.metrics import ServerMetrics
from kvserve.runtime.server.server_config import ServerConfig  # noqa: F401  (re-exported: its old home)
from kvserve.runtime.startup_phases import describe as describe_phases
from kvserve.runtime.tokenizer import chat_template
from kvserve.runtime.tracing import build_otlp_tracer

logger = logging.getLogger("kvserve.server")


@dataclass
class ServerState:
    config: ServerConfig
    engine: AsyncEngine | None = None
    tokenizer: Any = None
    metrics: ServerMetrics | None = None
    max_model_len: int = 0
    eos_token_ids: frozenset = frozenset()
    vocab_size: int = 0
    limits: Any = None  # the engine's sampling_params.RequestLimits: what a request is validated against
    max_token_chars: int = 64
    chat_template: str | None = None
    stopping: bool = False  # a stop signal came: /health is 503; new requests are still accepted until draining
    draining: bool = False  # new requests get 503; in-flight ones finish
    sleeping: bool = False  # --enable-sleep-mode: asleep or going to sleep (server/sleep_routes.py): not ready
    load_error: BaseException | None = None
    _group_ready: bool = False
    lora_modules: dict = field(default_factory=dict)  # --enable-lora: the start-up adapters (name -> directory)
    lora_enabled: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    created_monotonic: float = field(default_factory=time.monotonic)
    startup_phases: dict[str, float] = field(default_factory=dict)  # seconds per phase, set once ready
    on_fatal: Callable[[BaseException], None] | None = None  # loading failed: exit non-zero
    on_engine_dead: Callable[[BaseException], None] | None = None  # every request answered; exit non-zero
    # One worker: HF tokenizers mutate internal state on encode, so never use one from two threads at once.
    tokenize_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-tokenize")
    )
    # Grammars compile here, beside the event loop and off the engine's step (runtime/structured_output).
    grammar_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-grammar")
    )
    grammar_compiler: Any = None
    # Large request bodies are parsed here, not on the event loop.
    parse_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvserve-parse")
    )

    @property
    def asleep(self) -> bool:
        """Sleep mode: this server's /sleep is under way (`sleeping`), or the engine core is asleep -- with
        --api-server-count > 1 possibly put to sleep through another API server (its SLEEP_STATE)."""
        return self.sleeping or bool(self.engine is not None and self.engine.engine.sleeping)

    @property
    def ready(self) -> bool:
        return (
            self.engine is not None and self.engine.is_running and not (self.stopping or self.draining or self.asleep)
        )

    @property
    def group_ready(self) -> bool:
        """True once every API server of the group marked itself ready (always, outside a group)."""
        if self._group_ready or self.config.group_dir is None:
            return True
        markers = (_ready_marker(self.config.group_dir, i) for i in range(self.config.api_server_count))
        self._group_ready = all(os.path.exists(m) for m in markers)  # cached: servers do not un-ready
        return self._group_ready

    def attach_engine(self, llm_engine: EngineClient) -> None:
        """Wire up a loaded engine (in-process LLMEngine, or a client of a core process): tokenizer copy for the
        HTTP side, metrics, the async loop."""
        model_config = llm_engine.config.model
        self.max_model_len = int(model_config.max_model_len)
        self.eos_token_ids = frozenset(model_config.eos_token_ids)  # beam search ends hypotheses on these
        try:
            self.tokenizer = copy.deepcopy(llm_engine.tokenizer)  # the engine thread keeps its own
        except Exception:  # pragma: no cover - tokenizers that cannot be copied: share, guarded by one thread
            self.tokenizer = llm_engine.tokenizer
        self.vocab_size = len(self.tokenizer)
        self.grammar_compiler = _GrammarCompilerFactory(self.tokenizer, llm_engine.config)
        self.limits = llm_engine.limits
        lora = llm_engine.config.lora
        self.lora_modules = dict(lora.modules) if lora is not None else {}
        self.lora_enabled = lora is not None
        max_loras = lora.max_loras if lora is not None else None
        vocab = self.tokenizer.get_vocab()
        self.max_token_chars = max((len(t) for t in vocab), default=64) or 64
        self.chat_template = chat_template(self.tokenizer)
        cache = llm_engine.config.cache
        cache_info = {
            k: getattr(cache, k)
            for k in ("block_size", "num_blocks", "enable_prefix_caching", "kv_cache_dtype", "gpu_memory_utilization")
            if hasattr(cache, k)
        }
        if "num_blocks" in cache_info:
            cache_info["num_gpu_blocks"] = cache_info["num_blocks"]  # vLLM's label name (null block included)
        # Sliding-window models keep one block table per KV cache group over the one pool (capacity.py).
        num_groups = kv_sizing.layout(llm_engine.config).num_groups
        if self.config.api_server_count > 1:
            from kvserve.runtime.metrics_group import GroupServerMetrics

            self.metrics = GroupServerMetrics(
                self.config.api_server_index,
                self.config.served_model_names[0],
                self.max_model_len,
                cache_info,
                num_groups,
                max_loras,
            )
        else:
            self.metrics = ServerMetrics(
                self.config.served_model_names[0], self.max_model_len, cache_info, num_groups, max_loras
            )
        self.metrics.track_health(lambda: self.ready)
        tracer = self.config.request_tracer
        if tracer is None and self.config.otlp_traces_endpoint:
            tracer = build_otlp_tracer(self.config.otlp_traces_endpoint, self.config.served_model_names[0])
        self.engine = AsyncEngine(
            llm_engine,
            self.metrics,
            log_interval_s=self.config.log_interval_s,
            tracer=tracer,
            on_dead=self._engine_died,
        )
        self.engine.start()
        _freeze_startup_heap()
        if self.config.group_dir is not None:
            open(_ready_marker(self.config.group_dir, self.config.api_server_index), "w").close()
        num_blocks = cache_info.get("num_blocks")
        logger.info(
            "ready: model=%s max_model_len=%d kv_blocks=%s%s%s",
            self.config.served_model_names[0],
            self.max_model_len,
            num_blocks,
            "" if num_blocks is None else f" ({num_blocks - 1} usable + 1 reserved null block)",
            " (RANDOM WEIGHTS: output is gibberish)" if self.config.random_weights else "",
        )
        self._export_startup_phases(llm_engine)

    def _export_startup_phases(self, llm_engine: EngineClient) -> None:
        """kvserve:startup_phase_seconds and one log line: the phases timed before the engine (ServerConfig),
        the engine's own (the core process's through CoreReady, or the in-process runner's), and the total."""
        # CoreClient: what the core process sent; in-process LLMEngine: its executor's (rank 0's)
        phases = {**self.config.startup_phases_s, **llm_engine.startup_phases}
        started = self.config.started_monotonic
        phases["total"] = time.monotonic() - (self.created_monotonic if started is None else started)
        self.startup_phases = phases
        self.metrics.set_startup_phases(phases)
        logger.info("start-up phases: %s", describe_phases(phases))

    def _engine_died(self, exc: BaseException) -> None:
        if self.on_engine_dead is not None:
            self.on_engine_dead(exc)


def _ready_marker(group_dir: str, index: int) -> str:
    return os.path.join(group_dir, f"ready-{index}")


def _freeze_startup_heap() -> None:
    """Move everything alive after start-up (the tokenizer and its vocabulary, pydantic and FastAPI models,
    imported modules: ~320k objects in the demo-model server) out of the collector's reach. Streaming makes
    many short-lived objects per token, so full collections keep coming, and each one traversed that whole
    heap holding the GIL: 0.2-0.3 s per collection, twice in a 13 s run of 256 streams (both the event loop
    and the engine thread stall meanwhile). Objects still die by reference counting as before; only cycles
    among the frozen ones are never collected. vLLM's API server does the same (gc.collect(); gc.freeze())."""
    gc.collect()
    gc.freeze()


class _GrammarCompilerFactory:
    """Builds the xgrammar compiler on first use (most servers never see a structured request)."""

    def __init__(self, tokenizer: Any, engine_config: Any):
        self.tokenizer, self.engine_config, self._compiler = tokenizer, engine_config, None

    def compile(self, spec: Any) -> Any:
        if self._compiler is None:
            from kvserve.runtime.structured_output.compiler import GrammarCompiler

            self._compiler = GrammarCompiler.for_engine(self.tokenizer, self.engine_config)
        return self._compiler.compile(spec)

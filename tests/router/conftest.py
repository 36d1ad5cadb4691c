"""Fake replicas and a live router on 127.0.0.1, each a uvicorn server in a background thread.

A fake replica speaks just enough of kvserve's API (/v1/completions streaming SSE, /metrics, /health) and
misbehaves on demand (`mode`), and records what reached it, so tests can see retries, disconnects and
routing from both sides of the proxy.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any

import httpx
import pytest
import uvicorn
from kvserve_testing import STORIES_DIR  # examples/models/stories260K
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Threaded:
    def __init__(self, app: Any, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(
                app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on", timeout_graceful_shutdown=1
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class FakeReplica(Threaded):
    """mode: ok | 503 | 429 | break (one event, then a dropped connection) | hang (never sends a body byte)."""

    def __init__(self, name: str, events: int = 3, gap_s: float = 0.0, port: int | None = None):
        self.name, self.mode, self.events, self.gap_s = name, "ok", events, gap_s
        self.received: list[dict] = []
        self.cancelled = 0
        self.healthy = True
        self.adapters: list[str] = []  # LoRA adapters its /v1/models lists (parent = the base model "fake")
        self.extra_metrics = ""  # appended to /metrics (e.g. vllm:lora_requests_info)

        async def completions(request: Request) -> Response:
            body = await request.json()
            self.received.append(body)
            if self.mode == "503":
                return JSONResponse({"error": {"message": "draining"}}, status_code=503)
            if self.mode == "429":
                return JSONResponse({"error": {"message": "queue full"}}, status_code=429, headers={"Retry-After": "7"})
            mode = self.mode

            async def sse():
                try:
                    if mode == "hang":
                        await asyncio.sleep(60)
                    for i in range(self.events):
                        yield f"data: {json.dumps({'replica': self.name, 'i': i})}\n\n"
                        if mode == "break":
                            raise RuntimeError("replica died mid-stream")
                        await asyncio.sleep(self.gap_s)
                    yield "data: [DONE]\n\n"
                except asyncio.CancelledError:
                    self.cancelled += 1
                    raise

            return StreamingResponse(sse(), media_type="text/event-stream")

        async def metrics(request: Request) -> Response:
            return PlainTextResponse(
                "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0.0\n"
                "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.1\n"
                "# TYPE kvserve:kv_capacity_tokens gauge\nkvserve:kv_capacity_tokens 4096.0\n" + self.extra_metrics
            )

        async def health(request: Request) -> Response:
            return JSONResponse({"status": "ok"}, status_code=200 if self.healthy else 503)

        async def models(request: Request) -> Response:
            cards = [{"id": "fake", "owned_by": self.name, "parent": None}]
            cards += [{"id": name, "owned_by": self.name, "parent": "fake"} for name in self.adapters]
            return JSONResponse({"object": "list", "data": cards})

        app = Starlette(
            routes=[
                Route("/v1/completions", completions, methods=["POST"]),
                Route("/v1/chat/completions", completions, methods=["POST"]),
                Route("/metrics", metrics),
                Route("/health", health),
                Route("/v1/models", models),
            ]
        )
        super().__init__(app, port)


class WordTokenizer:
    """Stands in for PromptTokenizer: one token per whitespace-separated word (stable across calls)."""

    def token_ids(self, path: str, body: Any) -> list[int] | None:
        text = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(text, str):
            return None
        return [sum(map(ord, w)) % 50_000 for w in text.split()]


class LiveRouter(Threaded):
    def __init__(
        self,
        backends: list[str],
        tokenizer: Any = None,
        kv_events: Any = None,
        prefill: list[str] = (),
        decode: list[str] = (),
        **config: Any,
    ):
        from kvserve.runtime.router import discovery
        from kvserve.runtime.router.app import build_app
        from kvserve.runtime.router.config import RouterConfig
        from kvserve.runtime.router.proxy import Router

        config.setdefault("poll_interval_s", 0)
        config.setdefault("default_block_size", 4)
        found = discovery.static(backends, prefill, decode)
        self.router = Router(RouterConfig(seed=0, **config), tokenizer, found, kv_events=kv_events)
        super().__init__(build_app(self.router))
        deadline = time.monotonic() + 10
        while len(self.router.replicas.replicas) < len(set(backends) | set(prefill) | set(decode)):
            assert time.monotonic() < deadline
            time.sleep(0.02)

    def metric(self, name: str, **labels: str) -> float:
        return self.router.metrics.registry.get_sample_value(name, labels) or 0.0

    def poll(self) -> None:
        """Run one scrape/probe round on the router's own loop."""
        asyncio.run_coroutine_threadsafe(self.router.poll_once(), self.router.loop).result(10)

    def in_flight(self) -> int:
        """In-flight requests once the router settles: a slot is released after the response's last byte
        left, which can be just after the client has read it."""
        deadline = time.monotonic() + 5
        while True:
            n = sum(r.in_flight for r in self.router.replicas.replicas.values())
            if n == 0 or time.monotonic() > deadline:
                return n
            time.sleep(0.02)


class FakeEngine(Threaded):
    """A fake engine speaking vLLM's P/D protocol (tests/pd_fake_engine.py); `state` has what it received."""

    def __init__(self, name: str, mode: str = "ok"):
        from pd_fake_engine import EngineState

        self.state = EngineState(name, mode)
        super().__init__(self.state.app())


class Harness:
    """What the `fakes` fixture hands a test: factories for fake replicas and routers (stopped afterwards)."""

    WordTokenizer = WordTokenizer

    def __init__(self) -> None:
        self.made: list[Threaded] = []

    def __call__(self, *names: str, **kwargs: Any) -> list[FakeReplica]:
        out = [FakeReplica(n, **kwargs) for n in names]
        self.made.extend(out)
        return out

    def later(self, name: str, port: int, **kwargs: Any) -> FakeReplica:
        """A fake replica on a port the router already knows (it was not listening until now)."""
        replica = FakeReplica(name, port=port, **kwargs)
        self.made.append(replica)
        return replica

    def engines(self, *names: str, mode: str = "ok") -> list[FakeEngine]:
        out = [FakeEngine(n, mode) for n in names]
        self.made.extend(out)
        return out

    def router(self, backends: list[str], **kwargs: Any) -> LiveRouter:
        r = LiveRouter(backends, **kwargs)
        self.made.append(r)
        return r

    @staticmethod
    def dead_url() -> str:
        return f"http://127.0.0.1:{free_port()}"  # nothing listens there

    @staticmethod
    def completion(router: LiveRouter, prompt: str = "hello", stream: bool = True, **kwargs: Any) -> httpx.Response:
        return httpx.post(
            router.url + "/v1/completions",
            json={"prompt": prompt, "stream": stream},
            timeout=kwargs.pop("timeout", 20),
            **kwargs,
        )


@pytest.fixture()
def fakes():
    harness = Harness()
    yield harness
    for server in reversed(harness.made):
        server.stop()


class EngineReplica(Threaded):
    """A real `kvserve serve` app (build_app with a loaded engine) on a free port."""

    def __init__(self, model_dir: str, port: int | None = None, **engine_kwargs: Any):
        from kvserve.runtime.engine.llm_engine import LLMEngine
        from kvserve.runtime.server.app import build_app
        from kvserve.runtime.server.state import ServerConfig

        self.model_dir = model_dir
        self.engine = engine = LLMEngine.from_kwargs(model=model_dir, **engine_kwargs)
        app = build_app(
            ServerConfig(served_model_names=["stories"], model_dir=model_dir, log_interval_s=1.0), engine=engine
        )
        super().__init__(app, port)
        deadline = time.monotonic() + 60
        while httpx.get(self.url + "/health", timeout=2).status_code != 200:
            assert time.monotonic() < deadline, "replica did not become healthy"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def stories_replicas():
    replicas = [EngineReplica(str(STORIES_DIR), kv_cache_bytes=8 << 20, max_num_seqs=16, seed=0) for _ in range(2)]
    yield replicas
    for r in replicas:
        r.stop()


@pytest.fixture(scope="module")
def stories_event_replicas():
    """Two real replicas publishing their KV events on 127.0.0.1 (random ports, read back from the engine)."""
    config = json.dumps(
        {
            "enable_kv_cache_events": True,
            "endpoint": "tcp://127.0.0.1:*",
            "replay_endpoint": "tcp://127.0.0.1:*",
            "topic": "kv",
        }
    )
    replicas = [
        EngineReplica(str(STORIES_DIR), kv_cache_bytes=8 << 20, max_num_seqs=16, seed=0, kv_events_config=config)
        for _ in range(2)
    ]
    yield replicas
    for r in replicas:
        r.stop()
        r.engine.shutdown()

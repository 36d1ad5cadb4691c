"""A fake engine replica that speaks vLLM's P/D protocol (kv_transfer_params), for the router's P/D tests.

As a prefill instance (a body with kv_transfer_params.do_remote_decode) it answers one token and the
kv_transfer_params that say where its blocks are (NixlConnector's fields), or misbehaves on demand (`mode`).
Any other body is served whole: a D leg (kv_transfer_params.do_remote_prefill) or an aggregated request, its
text a pure function of the prompt, so a test can tell the client got the one complete answer. It records
every body and X-Request-Id it received. Runs in a thread (`FakeEngine`) or as its own process
(`python tests/pd_fake_engine.py PORT NAME [MODE]`), so a test can kill it mid-request.
"""

from __future__ import annotations

import asyncio
import json
import sys

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

# What a prefill engine reports having cached of the prompt (the usage rewrite shows it to the client).
PREFILL_CACHED_TOKENS = 4


def answer_tokens(body: dict) -> list[str]:
    """The completion's tokens: a pure function of the prompt (the same whichever replica serves it)."""
    prompt = body.get("prompt")
    if prompt is None:
        prompt = " ".join(str(m.get("content")) for m in body.get("messages") or [])
    words = str(prompt).split()
    n = int(body.get("max_tokens") or 4)
    return [f"w{len(words)}-{i}" for i in range(n)]


def prompt_tokens(body: dict) -> int:
    prompt = body.get("prompt")
    if prompt is None:
        prompt = " ".join(str(m.get("content")) for m in body.get("messages") or [])
    return len(str(prompt).split())


class EngineState:
    """mode (prefill side): ok | 500 | 503 | no_params | bad_json | hang | flaky (every other prefill: 500)."""

    def __init__(self, name: str, mode: str = "ok"):
        self.name, self.mode = name, mode
        self.received: list[dict] = []
        self.request_ids: list[str | None] = []
        self.waiting = 0  # reported as vllm:num_requests_waiting

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.completions, methods=["POST"]),
                Route("/metrics", self.metrics),
                Route("/health", lambda r: JSONResponse({"status": "ok"})),
                Route("/v1/models", lambda r: JSONResponse({"object": "list", "data": [{"id": "fake"}]})),
            ]
        )

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(
            f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting {self.waiting}.0\n"
            "# TYPE kvserve:kv_capacity_tokens gauge\nkvserve:kv_capacity_tokens 4096.0\n"
        )

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        self.received.append(body)
        self.request_ids.append(request.headers.get("x-request-id"))
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            return await self.prefill(body, request.headers.get("x-request-id"))
        return self.serve(body, pulled=bool(params.get("do_remote_prefill")))

    async def prefill(self, body: dict, request_id: str | None) -> Response:
        if self.mode == "hang":
            await asyncio.sleep(60)
        if self.mode == "flaky" and len(self.received) % 2 == 0:
            return JSONResponse({"error": {"message": "prefill failed"}}, status_code=500)
        await asyncio.sleep(0.05)  # a prefill takes a while: concurrent legs overlap
        if self.mode in ("500", "503"):
            return JSONResponse({"error": {"message": "prefill failed"}}, status_code=int(self.mode))
        if self.mode == "bad_json":
            return PlainTextResponse("not json", media_type="application/json")
        out = self.completion(body, ["p"], cached=PREFILL_CACHED_TOKENS)
        if self.mode != "no_params":
            out["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": f"engine-{self.name}",
                "remote_block_ids": [7, 8, 9],
                "remote_host": "127.0.0.1",
                "remote_port": 5600,
                "remote_request_id": request_id,
                "tp_size": 1,
            }
        return JSONResponse(out)

    def completion(self, body: dict, tokens: list[str], cached: int) -> dict:
        n = int(body.get("n") or 1)
        return {
            "id": "cmpl-fake",
            "object": "text_completion",
            "model": body.get("model", "fake"),
            "choices": [{"index": i, "text": " ".join(tokens), "finish_reason": "length"} for i in range(n)],
            "usage": {
                "prompt_tokens": prompt_tokens(body),
                "completion_tokens": len(tokens) * n,
                "total_tokens": prompt_tokens(body) + len(tokens) * n,
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        }

    def serve(self, body: dict, pulled: bool) -> Response:
        tokens = answer_tokens(body)
        # A decode engine that pulled the prompt's KV counts every prompt token as cached (vLLM does).
        cached = prompt_tokens(body) if pulled else 0
        if not body.get("stream"):
            return JSONResponse(self.completion(body, tokens, cached))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def sse():
            for tok in tokens:
                chunk = {"id": "cmpl-fake", "choices": [{"index": 0, "text": tok, "finish_reason": None}]}
                if include_usage:
                    chunk["usage"] = None
                yield f"data: {json.dumps(chunk)}\n\n"
                await asyncio.sleep(0.01)
            if include_usage:
                usage = self.completion(body, tokens, cached)["usage"]
                yield f"data: {json.dumps({'id': 'cmpl-fake', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")


def main(argv: list[str]) -> None:
    """As a process: stops itself after 120 s whatever happens (a test kills it long before)."""
    import os
    import threading

    import uvicorn

    threading.Timer(120, os._exit, args=(0,)).start()
    port, name = int(argv[0]), argv[1]
    state = EngineState(name, argv[2] if len(argv) > 2 else "ok")
    uvicorn.run(state.app(), host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main(sys.argv[1:])

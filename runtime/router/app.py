"""The router's HTTP front: the OpenAI-compatible routes, /health and /metrics in front of a Router."""

from __future__ import annotations

import time
from typing import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvserve.runtime.metrics import CONTENT_TYPE
from kvserve.runtime.router.pd import DECODE_CANDIDATES
from kvserve.runtime.router.proxy import ENDPOINT_HEADER, Router
from kvserve.runtime.server.errors import error_response


def build_app(router: Router) -> FastAPI:
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="kvserve router", lifespan=lifespan)
    app.state.router = router

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        now = time.monotonic()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization",)}
        for replica in sorted(router.replicas.routable(now), key=lambda r: r.in_flight)[:2]:
            try:
                resp = await router.client.get(replica.url + "/v1/models", headers=headers, timeout=10.0)
            except httpx.HTTPError as exc:
                router.control.eject(replica.url, "connect_error", exc)
                continue
            return Response(
                resp.content,
                status_code=resp.status_code,
                media_type=resp.headers.get("content-type", "application/json"),
                headers={ENDPOINT_HEADER: replica.url},
            )
        return error_response(503, "no replicas available", type="server_error")

    @app.get("/health")
    async def health() -> Response:
        replicas = router.replicas.replicas.values()
        # A prefill-only replica (P/D mode) cannot serve a request alone: it does not make the router ready.
        routable = sum(
            1 for r in replicas if r.ejected_until is None and not r.draining and r.role in DECODE_CANDIDATES
        )
        body = {
            "status": "ok" if routable else "holding" if router.held is not None else "no_replicas",
            "replicas": len(router.replicas.replicas),
            "routable": routable,
        }
        if router.held is not None:
            body["held"] = len(router.held)
        # A holding router is ready with no replica at all: at zero replicas it must take (and hold) the
        # requests whose count scales the model up.
        return JSONResponse(body, status_code=200 if routable or router.held is not None else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE)

    return app

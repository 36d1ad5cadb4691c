"""One API endpoint for the operator made of two servers: the real API server (tests/operator/apiserver.py) for
the custom resources' groups, kmock's emulator for everything the real server does not serve (core, apps,
autoscaling, policy, networking, rbac, coordination: the children, Events, Leases).

The operator (kopf and kvserve.operator.kube) is pointed at this router's plain-HTTP URL and cannot tell: each
request goes, bytes as they are and watch streams chunk by chunk, to the server that owns its API group; only
`GET /apis` is answered by merging both servers' group lists. It records every watch stream of the custom
resources and whether the real server ended one with `410 Gone`, and can cut the open streams (a network
blip, or the end of a watch's timeout) so that the client has to watch again.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

# API groups the real server holds: the InferenceService, CRDs, and the upstream kinds (installed as CRDs).
REAL_GROUPS = frozenset(
    {
        "serving.kvserve.dev",
        "apiextensions.k8s.io",
        "leaderworkerset.x-k8s.io",
        "keda.sh",
        "inference.networking.k8s.io",
    }
)
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "host"}


def owner(path: str) -> str:
    """'real' or 'emulator' for a request path."""
    parts = path.split("/")
    if len(parts) > 2 and parts[1] == "apis" and parts[2] in REAL_GROUPS:
        return "real"
    return "emulator"


@dataclass
class Watch:
    path: str
    query: str
    gone: bool = False  # the real server sent an ERROR event with code 410


@dataclass
class Router:
    real_url: str
    real_ssl: ssl.SSLContext
    emulator_url: str
    url: str = ""
    watches: list[Watch] = field(default_factory=list)
    requests: list[tuple[str, str, int]] = field(default_factory=list)  # (method, path, status) to the real one
    real_down_answers: int = 0  # requests answered 503 while the real server was unreachable
    _open: set[Any] = field(default_factory=set)
    _loop: asyncio.AbstractEventLoop | None = None

    # -- control from the test thread ------------------------------------------------------------------

    def cut_watches(self) -> int:
        """Close every open watch stream to the real server; returns how many were open."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(self._cut(), self._loop).result(10)

    async def _cut(self) -> int:
        streams = list(self._open)
        for response in streams:
            response.force_close()
            transport = response._req.transport if response._req is not None else None
            if transport is not None:
                transport.close()
        return len(streams)

    # -- serving -------------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path == "/apis" and request.method == "GET":
            return await self._merged_groups()
        real = owner(path) == "real"
        base = self.real_url if real else self.emulator_url
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        body = await request.read()
        is_watch = request.query.get("watch") in ("true", "1")
        watch = Watch(path, request.query_string) if (is_watch and real) else None
        try:
            upstream = await self._session.request(
                request.method,
                base + path,
                params=list(request.query.items()),
                data=body or None,
                headers=headers,
                ssl=self.real_ssl if real else False,
                timeout=aiohttp.ClientTimeout(total=None, sock_read=None),
            )
        except aiohttp.ClientError as exc:
            if real:
                self.real_down_answers += 1
            return web.json_response(
                {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 503, "message": str(exc)},
                status=503,
            )
        if real:
            self.requests.append((request.method, path, upstream.status))
        response = web.StreamResponse(status=upstream.status)
        for key, value in upstream.headers.items():
            if key.lower() not in _HOP_HEADERS:
                response.headers[key] = value
        await response.prepare(request)
        if watch is not None:
            self.watches.append(watch)
            self._open.add(response)
        try:
            async for chunk in upstream.content.iter_any():
                if watch is not None and b'"code":410' in chunk:
                    watch.gone = True
                await response.write(chunk)
        except (aiohttp.ClientError, ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            upstream.release()
            self._open.discard(response)
        return response

    async def _merged_groups(self) -> web.Response:
        """The emulator's /apis plus each real group the real server serves (its /apis answers 404: the
        standalone apiextensions-apiserver has no aggregated group list, only /apis/GROUP)."""
        async with self._session.get(self.emulator_url + "/apis", headers={"Accept": "application/json"}) as resp:
            groups = [g for g in (await resp.json()).get("groups") or [] if g.get("name") not in REAL_GROUPS]
        for name in sorted(REAL_GROUPS):
            async with self._session.get(f"{self.real_url}/apis/{name}", ssl=self.real_ssl) as resp:
                if resp.status == 200:
                    groups.append(await resp.json(content_type=None))
        return web.json_response({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})

    def start(self) -> None:
        started = threading.Event()
        self._stop: asyncio.Event | None = None

        async def serve() -> None:
            self._stop = asyncio.Event()
            self._session = aiohttp.ClientSession()
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", self._handle)
            # The operator's client keeps idle connections open: do not wait for them on the way out.
            runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]
            self.url = f"http://127.0.0.1:{port}"
            started.set()
            await self._stop.wait()
            await self._cut()
            await self._session.close()  # its keep-alive connections would hold the emulator's shutdown
            await runner.cleanup()

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=lambda: self._loop.run_until_complete(serve()), daemon=True)
        self._thread.start()
        assert started.wait(10), "router did not start"

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)

"""The router's data path: a request in, the best replica out, bytes streamed through (app.py puts the
OpenAI-compatible routes in front of it).

Per request: parse -> tokenise off the event loop -> rank (scoring.rank) -> record the choice in the prefix
index -> dispatch -> wait for the first upstream body chunk while watching for the client leaving -> stream
the rest through unbuffered. Before the first chunk nothing has reached the client, so a replica that refuses
the connection, resets it or answers 503 is ejected and the request goes to the next-ranked replica (once by
default). After that, bytes flow through untouched; a broken upstream ends an SSE stream with an error event.
A client that disconnects closes the upstream connection, which makes the replica abort the request.
What the router believes about each replica (scrapes, probes, ejections, held requests) is the control
loop's (control.py): this side reads it and reports the failures it sees.

P/D mode (some replica has the prefill role; rules in pd.py, the legs in pd_legs.py): the decode replica is
ranked as above among decode and both replicas; the rule then decides whether to prefill remotely; if so the
prefill replica is ranked with the same scorers among prefill and both replicas, the P leg runs to its end,
and the D leg is dispatched as any request, with P's kv_transfer_params in its body. A failed P leg leaves
the request aggregated on the decode replica.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvserve.runtime.router.config import RouterConfig
from kvserve.runtime.router.control import ReplicaControl
from kvserve.runtime.router.hold import HoldRejected
from kvserve.runtime.router.metrics import RouterMetrics
from kvserve.runtime.router.pd import (
    DECODE_CANDIDATES,
    FALLBACK,
    LOCAL,
    PREFILL_CANDIDATES,
    REMOTE,
    PDRule,
    decode_body,
    estimate_prompt_tokens,
    prefill_body,
    prefill_queue,
)
from kvserve.runtime.router.pd_legs import PrefillFailed, prefill_leg, usage_rewritten
from kvserve.runtime.router.scoring import Decision, HashCache, RequestFeatures, rank
from kvserve.runtime.server.errors import error_response

logger = logging.getLogger("kvserve.router")

# Hop-by-hop and encoding headers are the proxy's own business (RFC 9110 7.6.1; production-stack #827:
# forwarding content-encoding after the client library decompressed the body corrupted responses).
HOP_HEADERS = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "content-encoding",
    "host",
    "accept-encoding",
}
ENDPOINT_HEADER = "x-kvserve-endpoint"


class _Retryable(Exception):
    def __init__(self, cause: str, response: httpx.Response | None = None):
        super().__init__(cause)
        self.cause, self.response = cause, response


class _ClientGone(Exception):
    pass


@dataclass
class _PDPlan:
    """How a request is served in P/D mode: `path` (pd.REMOTE, LOCAL, FALLBACK) and, after a remote prefill,
    the D leg's body and headers, the decode replica's prefill work (none: the KV is pulled) and the prefill
    engine's cache hit for the usage rewrite."""

    path: str
    body: bytes | None = None
    headers: dict[str, str] | None = None
    cached_tokens: int | None = None

    @property
    def remote(self) -> bool:
        return self.path == REMOTE


class Router:
    """One router process: the data path here, the control loop in `self.control` (app.build_app puts HTTP
    routes in front of it)."""

    def __init__(
        self,
        config: RouterConfig,
        tokenizer: Any = None,
        discovery: Callable[["Router"], Awaitable[None]] | None = None,
        kv_events: Any = None,  # kv_subscriber.KVEventSubscriptions: score from the replicas' own KV events
    ):
        self.config = config
        self.tokenizer = tokenizer  # PromptTokenizer or None (then routing is on load only)
        self.discovery = discovery
        self.metrics = RouterMetrics()
        self.control = ReplicaControl(config, self.metrics)
        # The control loop keeps the replicas current; the data path records only its own traffic there (in-flight
        # leases, the prefix index at dispatch, sessions, a served response).
        self.replicas = self.control.replicas
        self.kv_events = kv_events
        if kv_events is not None:
            self.replicas.index = kv_events.index_over(self.replicas.index)
        self.held = self.control.held
        self.rng = random.Random(config.seed)
        self.pd_rule = PDRule(
            config.pd_decider,
            config.max_local_prefill_length,
            config.max_prefill_queue,
            config.remote_prefill_min_uncached_ratio,
        )
        self.client: httpx.AsyncClient | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        # One thread: HF tokenizers are not safe to share across threads; it keeps /health and streaming
        # responsive while a long prompt is tokenised (production-stack #1016 starved its probes this way).
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-router-tokenize")

    # ---- lifecycle -------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        # No pool cap (aiohttp's default of 100 silently capped production-stack, their #765) and no total
        # timeout: a stream lasts as long as it produces bytes.
        self.client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            timeout=httpx.Timeout(
                connect=self.config.connect_timeout_s, read=self.config.read_timeout_s, write=60.0, pool=None
            ),
        )
        self.control.client = self.client
        if self.discovery is not None:
            self._tasks.append(asyncio.create_task(self.discovery(self)))
        if self.config.poll_interval_s > 0:
            self._tasks.append(asyncio.create_task(self.control.poll_forever()))
        if self.kv_events is not None:
            self._tasks.append(asyncio.create_task(self.kv_events.run(self)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.client is not None:
            await self.client.aclose()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    # ---- the control loop's entry points (discovery calls set_endpoints, tests drive poll_once) -------------
    def set_endpoints(
        self, ready: set[str], draining: set[str] = frozenset(), roles: dict[str, str] | None = None
    ) -> None:
        self.control.set_endpoints(ready, draining, roles)

    async def poll_once(self) -> None:
        await self.control.poll_once()

    # ---- routing ---------------------------------------------------------------------------------------------
    async def decide(
        self, path: str, payload: Any, session_key: str | None, adapter: str | None = None
    ) -> tuple[Decision, HashCache | None]:
        started = time.perf_counter()
        token_ids = None
        if self.tokenizer is not None:
            token_ids = await asyncio.get_running_loop().run_in_executor(
                self._tokenize_pool, self.tokenizer.token_ids, path, payload
            )
        hashes = HashCache(token_ids, adapter=adapter) if token_ids else None
        now = time.monotonic()
        # Prefill-only replicas never take a whole request (P/D mode); without roles every replica serves both.
        views = [self.replicas.view(r, now) for r in self.replicas.routable(now, DECODE_CANDIDATES)]
        features = RequestFeatures(
            hashes_for=hashes,
            num_prompt_tokens=len(token_ids) if token_ids else 0,
            session_url=self.replicas.sessions.get(session_key),
            adapter=adapter,
        )
        decision = rank(features, views, self.replicas.index, self.config.weights, self.rng)
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        if decision.ranked:
            best = decision.ranked[0]
            self.metrics.prefix_match_ratio.observe(
                best.matched_blocks / best.total_blocks if best.total_blocks else 0.0
            )
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("route %s -> %s (%s): %s", path, best.url, decision.reason, decision.describe())
        return decision, hashes

    async def forward(self, request: Request, path: str) -> Response:
        body = await request.body()
        if len(body) > self.config.max_request_body_bytes:
            return error_response(
                413, f"request body exceeds {self.config.max_request_body_bytes} bytes", type="invalid_request_error"
            )
        try:
            payload = json.loads(body)
        except ValueError as exc:
            return error_response(400, f"request body is not valid JSON: {exc}", type="invalid_request_error")
        session_key = request.headers.get(self.config.session_header) if self.config.session_header else None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        headers["accept-encoding"] = "identity"
        model = payload.get("model") if isinstance(payload, dict) else None
        model = model if isinstance(model, str) else ""
        adapter = model if model and model in self.replicas.adapter_names() else None
        deadline = time.monotonic() + self.config.hold_timeout_s
        reprobed = False
        plan: _PDPlan | None = None  # P/D mode: decided once; a retry round reuses P's kv_transfer_params
        while True:
            if self.held is not None and not self.replicas.ready():
                refused = await self._hold(request, model, deadline)
                if refused is not None:
                    return refused
            decision, hashes = await self.decide(path, payload, session_key, adapter)
            if decision.ranked:
                if plan is None and isinstance(payload, dict) and self.replicas.pd_active():
                    try:
                        plan = await _race_disconnect(
                            request, self._plan_pd(path, payload, headers, decision, hashes, adapter)
                        )
                    except _ClientGone:
                        self.metrics.client_disconnects.inc()
                        return Response(status_code=499)
                remote = plan is not None and plan.remote
                response, last_error = await self._dispatch(
                    request,
                    path,
                    plan.body if remote else body,
                    plan.headers if remote else headers,
                    decision,
                    hashes,
                    session_key,
                    adapter,
                    plan=plan,
                )
                if response is not None:
                    return response
            elif self.held is None:
                self.metrics.failed.labels("no_replicas").inc()
                return error_response(503, "no replicas available", type="server_error")
            if self.held is None and not reprobed and await self.control.reprobe_ejected():
                reprobed = True  # a replica ejected earlier is healthy again: one more round, nothing was sent yet
                continue
            if self.held is None:
                self.metrics.failed.labels("all_attempts_failed").inc()
                return error_response(502, f"no replica could take the request ({last_error})", type="server_error")
            # Holding: every replica tried failed before answering (each is ejected now), so nothing reached
            # the client: wait for a ready replica again, within the same deadline.

    # ---- P/D mode ----------------------------------------------------------------------------------------------
    async def _plan_pd(
        self,
        path: str,
        payload: dict,
        headers: dict[str, str],
        decision: Decision,
        hashes: HashCache | None,
        adapter: str | None,
    ) -> _PDPlan:
        """Decide remote prefill or not for the best decode replica, and run the P leg when remote."""
        best = decision.ranked[0]
        if hashes is not None:
            prompt_tokens, uncached = len(hashes.token_ids), best.uncached_tokens
        else:  # no tokenizer (or an unreadable body): estimated length, nothing known to be cached
            prompt_tokens = uncached = estimate_prompt_tokens(path, payload)
        remote, reason = self.pd_rule.by_length(prompt_tokens, uncached)
        if not remote:
            return self._pd_path(LOCAL, reason)
        now = time.monotonic()
        views = {r.url: self.replicas.view(r, now) for r in self.replicas.routable(now, PREFILL_CANDIDATES)}
        features = RequestFeatures(hashes_for=hashes, num_prompt_tokens=prompt_tokens, adapter=adapter)
        ranked = rank(features, list(views.values()), self.replicas.index, self.config.weights, self.rng).ranked
        if not ranked:
            return self._pd_path(LOCAL, "no_prefill_replica")
        chosen = ranked[0]
        if chosen.url == best.url:  # a both replica is the best at both: prefilling there is local
            return self._pd_path(LOCAL, "same_replica")
        view = views[chosen.url]
        room, why = self.pd_rule.by_queue(prefill_queue(view.waiting, view.in_flight))
        if not room:
            return self._pd_path(LOCAL, why)

        url = chosen.url
        replica = self.replicas.replicas.get(url)
        if hashes is not None and replica is not None:  # P caches the prompt's blocks too
            self.replicas.index.record(
                url, hashes(self.replicas.block_size(replica)), self.replicas.capacity_blocks(replica)
            )
        leg_headers = {**headers, "x-request-id": str(uuid.uuid4())}  # one id for both legs (vLLM's toy proxy)
        self.metrics.requests.labels(url, "prefill").inc()
        lease = _Lease(self, url, chosen.uncached_tokens, adapter)
        started = time.perf_counter()
        try:
            answer = await prefill_leg(
                self.client,
                url + path,
                json.dumps(prefill_body(payload)).encode(),
                leg_headers,
                self.config.prefill_timeout_s,
            )
        except PrefillFailed as exc:
            self.metrics.prefill_leg_seconds.labels(url, exc.cause).observe(time.perf_counter() - started)
            if exc.cause in ("connect_error", "reset", "http_503"):
                self.control.eject(url, f"prefill_{exc.cause}", exc)
            logger.warning("prefill leg on %s failed (%s): serving %s aggregated", url, exc, path)
            return self._pd_path(FALLBACK, exc.cause)
        finally:
            await lease.release()
        self.metrics.prefill_leg_seconds.labels(url, "ok").observe(time.perf_counter() - started)
        self.replicas.served(url)
        body = json.dumps(decode_body(payload, answer.kv_transfer_params)).encode()
        return self._pd_path(REMOTE, reason, body, leg_headers, answer.cached_tokens)

    def _pd_path(self, path: str, reason: str, *rest) -> _PDPlan:
        self.metrics.pd_requests.labels(path, reason).inc()
        return _PDPlan(path, *rest)

    async def _hold(self, request: Request, model: str, deadline: float) -> Response | None:
        """Hold the request until a replica is ready (None) or answer it: 503 + Retry-After when the hold is
        full or timed out, 499 when the client left."""
        try:
            waited = await _race_disconnect(request, self.control.wait_for_ready(model, deadline))
        except _ClientGone:
            self.metrics.hold_outcomes.labels("client_gone").inc()
            self.metrics.client_disconnects.inc()
            return Response(status_code=499)
        except HoldRejected as exc:
            self.metrics.hold_outcomes.labels(exc.reason).inc()
            self.metrics.failed.labels(exc.reason).inc()
            return error_response(
                503,
                exc.message,
                type="server_error",
                code=exc.reason,
                headers={"Retry-After": str(self.config.hold_retry_after_s)},
            )
        if waited > 0:
            self.metrics.hold_outcomes.labels("forwarded").inc()
            self.metrics.hold_seconds.observe(waited)
        return None

    async def _dispatch(
        self,
        request: Request,
        path: str,
        body: bytes,
        headers: dict[str, str],
        decision: Decision,
        hashes: HashCache | None,
        session_key: str | None,
        adapter: str | None = None,
        plan: _PDPlan | None = None,
    ) -> tuple[Response | None, str]:
        """Try the ranked replicas (at most max_attempts); (response, "") once one answers, (None, last error)
        when every attempt failed before any byte reached the client."""
        last_error = "no attempt made"
        attempts = min(self.config.max_attempts, len(decision.ranked))
        for attempt, score in enumerate(decision.ranked[: self.config.max_attempts]):
            replica = self.replicas.replicas.get(score.url)
            if replica is None:  # removed by discovery while we were deciding
                continue
            url = score.url
            if hashes is not None:  # recorded at dispatch, so simultaneous identical prompts stick together
                self.replicas.index.record(
                    url, hashes(self.replicas.block_size(replica)), self.replicas.capacity_blocks(replica)
                )
            self.metrics.requests.labels(url, decision.reason if attempt == 0 else "retry").inc()
            remote = plan is not None and plan.remote  # the D leg: the KV is pulled, not prefilled there
            lease = _Lease(self, url, 0 if remote else score.uncached_tokens, adapter)
            upstream = self.client.build_request("POST", url + path, content=body, headers=headers)
            # The last replica's 503 (draining, loading) goes to the client, unless requests are held: then
            # the replica is ejected and the request waits for a ready one.
            last = attempt + 1 >= attempts and self.held is None
            try:
                resp, first_chunk, chunks = await _race_disconnect(request, self._open(upstream, url, last))
            except _ClientGone:
                await lease.release()
                self.metrics.client_disconnects.inc()
                return Response(status_code=499), ""
            except _Retryable as exc:
                await lease.release()
                self.control.eject(url, exc.cause, exc)
                self.metrics.retries.labels(url, exc.cause).inc()
                last_error = f"{url}: {exc.cause}"
                continue
            except httpx.TimeoutException as exc:  # the replica may be working on it: never run it twice
                await lease.release()
                self.metrics.failed.labels("upstream_timeout").inc()
                return (
                    error_response(504, f"replica {url} timed out: {type(exc).__name__}", type="server_error"),
                    "",
                )
            self.replicas.served(url)
            self.replicas.sessions.put(session_key, url)
            self.metrics.responses.labels(url, str(resp.status_code)).inc()
            out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
            out_headers[ENDPOINT_HEADER] = url
            is_sse = resp.headers.get("content-type", "").startswith("text/event-stream")
            content = _relay(self, url, resp, first_chunk, chunks, is_sse)
            if remote and plan.cached_tokens is not None and resp.status_code == 200:
                content = usage_rewritten(content, is_sse, plan.cached_tokens)
            response = _LeasedStreamingResponse(
                content,
                lease,
                status_code=resp.status_code,
                headers=out_headers,
            )
            return response, ""
        return None, last_error

    async def _open(
        self, upstream: httpx.Request, url: str, last: bool
    ) -> tuple[httpx.Response, bytes, AsyncIterator[bytes]]:
        """Send and wait for the first body chunk. Raises _Retryable for failures that are safe to retry
        (nothing reached the client and the replica did not take the request, or died before answering)."""
        dispatched = time.perf_counter()
        try:
            resp = await self.client.send(upstream, stream=True)
        except httpx.ConnectError as exc:
            raise _Retryable("connect_error", None) from exc
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            raise _Retryable("reset_before_response", None) from exc
        try:
            if resp.status_code == 503 and not last:
                raise _Retryable("http_503", resp)
            chunks = resp.aiter_raw()
            try:
                first = await chunks.__anext__()
            except StopAsyncIteration:
                first = b""
            except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                raise _Retryable("reset_before_first_byte", resp) from exc
            self.metrics.upstream_ttft.labels(url).observe(time.perf_counter() - dispatched)
            return resp, first, chunks
        except BaseException:  # retry, cancellation (client gone), timeout: this response is finished
            await resp.aclose()
            raise


class _Lease:
    """One in-flight slot on a replica plus the request's uncached prompt tokens (the work it brought there)
    and its LoRA adapter (the router knows it is running there before the replica's metric says so).
    Both are held until the request ends -- the first byte does not mark the end of prefill: a chat stream
    starts with a role-only chunk before any prefill -- and released exactly once however it ends (GIE #2064
    leaked capacity when completion hooks were skipped on errors and disconnects)."""

    def __init__(self, router: Router, url: str, prefill_tokens: int = 0, adapter: str | None = None):
        self.router, self.url, self.released = router, url, False
        self.prefill_tokens, self.adapter = prefill_tokens, adapter
        replica = router.replicas.replicas.get(url)
        if replica is not None:
            replica.in_flight += 1
            replica.in_flight_prefill_tokens += prefill_tokens
            if adapter is not None:
                replica.in_flight_adapters[adapter] += 1
            router.metrics.in_flight.labels(url).set(replica.in_flight)

    async def release(self) -> None:
        if self.released:
            return
        self.released = True
        replica = self.router.replicas.replicas.get(self.url)
        if replica is not None:
            replica.in_flight -= 1
            replica.in_flight_prefill_tokens -= self.prefill_tokens
            if self.adapter is not None:
                replica.in_flight_adapters[self.adapter] -= 1
                if replica.in_flight_adapters[self.adapter] <= 0:
                    del replica.in_flight_adapters[self.adapter]
            self.router.metrics.in_flight.labels(self.url).set(replica.in_flight)


class _LeasedStreamingResponse(StreamingResponse):
    """A StreamingResponse that frees its lease even when the body iterator never starts (the client left
    between the headers and the first body write)."""

    def __init__(self, content: AsyncIterator[bytes], lease: _Lease, **kwargs: Any):
        super().__init__(content, **kwargs)
        self.lease, self._content = lease, content

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._content.aclose()  # runs _relay's finally (closes upstream) if it was started
            await self.lease.release()


async def _relay(
    router: Router, url: str, resp: httpx.Response, first: bytes, chunks: AsyncIterator[bytes], is_sse: bool
) -> AsyncIterator[bytes]:
    """Upstream bytes to the client as they arrive (no buffering, no parsing: `[DONE]` may be split across
    reads). A client disconnect cancels this generator; the finally closes the upstream connection."""
    try:
        if first:
            yield first
        async for chunk in chunks:
            yield chunk
    except httpx.HTTPError as exc:
        router.control.eject(url, "stream_broken", exc)
        logger.warning("upstream %s broke mid-response: %s", url, exc)
        if is_sse:  # end the stream the way kvserve's server reports a failed request
            error = {
                "error": {
                    "message": f"replica {url} failed mid-stream: {type(exc).__name__}",
                    "type": "server_error",
                    "param": None,
                    "code": "upstream_error",
                }
            }
            yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        else:
            raise
    finally:
        await resp.aclose()


async def _race_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work` unless the client disconnects first (then cancel it and raise _ClientGone). The request
    body has been read, so the next ASGI message can only be the disconnect."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise _ClientGone()

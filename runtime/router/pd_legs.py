"""P/D mode's I/O (router/pd.py holds the rules): the prefill leg, and the decode leg's usage rewrite.

The prefill leg is one non-streamed POST; every way it can fail becomes `PrefillFailed(cause)`, and the proxy
then serves the request aggregated on the decode replica with the client's own body: nothing has reached the
client yet, so the client still sees one answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx

from kvserve.runtime.router.pd import PrefillAnswer, SSEUsageRewriter, parse_prefill_answer, rewrite_json_usage


class PrefillFailed(Exception):
    def __init__(self, cause: str, detail: object = None):
        super().__init__(f"{cause}: {detail}" if detail is not None else cause)
        self.cause = cause


async def prefill_leg(
    client: httpx.AsyncClient, url: str, body: bytes, headers: dict[str, str], timeout_s: float
) -> PrefillAnswer:
    """POST the P leg's body and return the prefill engine's kv_transfer_params. Raises PrefillFailed with
    cause connect_error, reset (the connection broke: the replica died mid-request), timeout (the whole leg
    took longer than timeout_s), http_<code> (any non-200), bad_answer (not JSON) or no_kv_transfer_params."""
    try:
        resp = await asyncio.wait_for(client.post(url, content=body, headers=headers), timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException) as exc:
        raise PrefillFailed("timeout", type(exc).__name__) from None
    except httpx.ConnectError as exc:
        raise PrefillFailed("connect_error", exc) from None
    except httpx.HTTPError as exc:  # RemoteProtocolError, ReadError, WriteError: the replica went away
        raise PrefillFailed("reset", type(exc).__name__) from None
    if resp.status_code != 200:
        raise PrefillFailed(f"http_{resp.status_code}", resp.text[:200])
    try:
        return parse_prefill_answer(resp.content)
    except ValueError as exc:
        cause = "no_kv_transfer_params" if "kv_transfer_params" in str(exc) else "bad_answer"
        raise PrefillFailed(cause, exc) from None


async def usage_rewritten(body: AsyncIterator[bytes], is_sse: bool, cached_tokens: int) -> AsyncIterator[bytes]:
    """The decode leg's bytes with usage.prompt_tokens_details.cached_tokens set to the prefill engine's hit.
    A stream passes event by event; a JSON answer is one document, so it is read whole, then rewritten."""
    try:
        if is_sse:
            rewriter = SSEUsageRewriter(cached_tokens)
            async for chunk in body:
                for event in rewriter.feed(chunk):
                    yield event
            rest = rewriter.flush()
            if rest:
                yield rest
        else:
            whole = b"".join([chunk async for chunk in body])
            yield rewrite_json_usage(whole, cached_tokens)
    finally:
        await body.aclose()  # closes the upstream response now, not when the generator is collected

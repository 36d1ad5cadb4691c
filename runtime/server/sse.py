"""Server-sent events for both generation endpoints: what each engine step added to each choice, the
chunk encoder, and the envelope every stream shares (usage chunk, error event, [DONE])."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from kvserve.runtime.engine.async_engine import RequestStream
from kvserve.runtime.errors import RequestFailedError
from kvserve.runtime.server.errors import engine_error


@dataclass
class Delta:
    """What one step added to one streamed choice."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list | None  # per new token
    text_offset: int  # characters of this choice sent before this delta
    finish_reason: str | None
    stop_reason: Any


@dataclass
class Choice:
    """Streaming progress of one choice: what has been sent so far."""

    index: int
    sent_text_len: int = 0
    sent_tokens: int = 0
    num_tokens: int = 0  # generated so far, sent or not (usage)
    finish_reason: str | None = None
    stop_reason: Any = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """(prompt index, cumulative output) from several streams as they come; (i, None) when one ends."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        yield 0, None
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
            await queue.put((i, None))
        except BaseException as exc:
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                remaining -= 1
            yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def choice_deltas(streams: list[RequestStream], n: int, choices: dict[int, Choice]) -> AsyncIterator[Delta]:
    """What each engine step added to each choice (choice index = prompt index * n + sample index). A
    delta per step with new tokens, even when their text is held back (a partial UTF-8 character, a
    possible stop string) and the text is "": clients see every token's timing (ITL), as with vLLM.
    Choices cut off by a drain timeout end with an "abort" delta."""
    async for i, out in merged(streams):
        if out is None:
            if streams[i].aborted:
                for k in range(n):
                    ch = choices.setdefault(i * n + k, Choice(i * n + k))
                    if ch.finish_reason is None:
                        ch.finish_reason = "abort"
                        yield Delta(ch.index, "", [], None, ch.sent_text_len, "abort", None)
            continue
        for c in out.outputs:
            ch = choices.setdefault(i * n + c.index, Choice(i * n + c.index))
            if ch.finish_reason is not None:
                continue
            ch.num_tokens = len(c.token_ids)
            text = c.text[ch.sent_text_len :]
            new_ids = c.token_ids[ch.sent_tokens :]
            if not text and not c.finish_reason and not new_ids:
                continue
            logprobs = c.logprobs[ch.sent_tokens :] if c.logprobs is not None else None
            delta = Delta(
                ch.index,
                text,
                new_ids,
                logprobs,
                ch.sent_text_len,
                c.finish_reason,
                c.stop_reason if c.finish_reason else None,
            )
            ch.sent_text_len += len(text)
            ch.sent_tokens = len(c.token_ids)
            ch.finish_reason = c.finish_reason
            yield delta


async def sse_stream(
    events: AsyncIterator[str],
    streams: list[RequestStream],
    base: dict,
    usage: Callable[[int], dict[str, int]],
    choices: dict[int, Choice],
    include_usage: bool,
) -> AsyncIterator[str]:
    """The SSE envelope shared by both endpoints: the events, a usage chunk if asked for, an error event
    if the engine failed the request, then [DONE]; the requests are aborted however the stream ends
    (a client that disconnects frees its KV blocks)."""
    try:
        async for event in events:
            yield event
        if include_usage:
            completion_tokens = sum(ch.num_tokens for ch in choices.values())
            yield sse({**base, "choices": [], "usage": usage(completion_tokens)})
    except RequestFailedError as exc:
        yield sse(engine_error(exc).body())
    finally:
        for stream in streams:
            stream.abort()
    yield "data: [DONE]\n\n"


_JSON = json.JSONEncoder(ensure_ascii=False)  # what json.dumps(..., ensure_ascii=False) builds on every call


def sse(payload: dict) -> str:
    return f"data: {_JSON.encode(payload)}\n\n"


def _json_value(value: Any) -> str:
    return "null" if value is None else _JSON.encode(value)


class ChunkEncoder:
    """One streamed choice chunk as SSE: byte for byte `sse({**base, "choices": [{"index": i, field: value,
    "logprobs": ..., "finish_reason": ..., "stop_reason": ...}], ["usage": None]})`, with the constant parts
    (id, object, created, model, the keys) encoded once per response instead of once per token: with 256
    streams the API server encodes a chunk per stream per engine step. json.dumps without indent encodes a
    nested value exactly as it encodes that value alone, so splicing the encoded values gives the same bytes
    (tests/server/test_sse_encoding.py)."""

    __slots__ = ("_head", "_tail", "_field")

    def __init__(self, base: dict, field: str, include_usage: bool):
        self._head = "data: " + _JSON.encode(base)[:-1] + ', "choices": [{"index": '
        self._field = f', "{field}": '
        self._tail = '], "usage": null}\n\n' if include_usage else "]}\n\n"

    def __call__(self, index: int, value: Any, logprobs: Any, finish: str | None, stop_reason: Any = None) -> str:
        return (
            f'{self._head}{index}{self._field}{_JSON.encode(value)}, "logprobs": {_json_value(logprobs)}, '
            f'"finish_reason": {_json_value(finish)}, "stop_reason": {_json_value(stop_reason)}}}{self._tail}'
        )

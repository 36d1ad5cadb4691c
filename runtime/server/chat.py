"""POST /v1/chat/completions: the chat template, tool calls (held back while a choice may become one),
structured outputs, logprobs in the chat shape, beam search, one JSON body or an SSE stream (server/sse.py).
The shared plumbing is OpenAIServing's (server/serving.py)."""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.runtime.engine.async_engine import RequestStream
from kvserve.runtime.server import beam, structured
from kvserve.runtime.server.errors import bad_request
from kvserve.runtime.server.logprobs import LogprobFormatter
from kvserve.runtime.server.protocol import ChatCompletionRequest
from kvserve.runtime.server.serving import OpenAIServing, Prepared, kv_transfer_response
from kvserve.runtime.server.sse import Choice, ChunkEncoder, choice_deltas, sse_stream


async def create_chat_completion(serving: OpenAIServing, request: Request) -> Response:
    serving.check_auth(request)
    engine = serving.check_ready()
    body: ChatCompletionRequest = await serving.parse(request, ChatCompletionRequest)
    lora_name = await serving.check_model(body.model)
    tools = structured.tool_plan(body, serving.state.config.tool_call_parser)
    spec = structured.output_spec(body)
    if spec is not None and tools.constrained:
        raise bad_request(
            f"{spec.field} cannot be combined with tool_choice {body.tool_choice!r}: the tool "
            "call is the structured output.",
            param=spec.field,
        )
    spec = spec or structured.tool_spec(tools)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{param_name} must be at least 1, got {max_tokens}.", param=param_name)
    if body.top_logprobs is not None and not body.logprobs and body.top_logprobs > 0:
        raise bad_request("top_logprobs requires logprobs to be true.", param="top_logprobs")
    serving.check_queue(engine)

    text = await serving.render_chat(body.messages, body.add_generation_prompt, tools.tools)
    ids = await serving.encode(text, "messages", add_special_tokens=False)
    if not ids:
        raise bad_request("messages rendered to an empty prompt.", param="messages")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if body.use_beam_search:
        beam.check(body, logprobs, spec is not None)
        model = serving.state.config.served_model_names[0] if body.model is None else body.model
        return await beam.chat_response(
            serving, engine, request, body, ids, max_tokens, lora_name, model, int(time.time())
        )
    params = await serving.compile_grammar(
        serving.sampling_params(body, max_tokens, logprobs, ids, "messages", spec, lora_name)
    )
    prepared = Prepared(f"chatcmpl-{uuid.uuid4().hex}", [text], [ids], [params], body.n)
    streams = await serving.add_all(engine, prepared, request)
    created = int(time.time())
    model = serving.state.config.served_model_names[0] if body.model is None else body.model
    if body.stream:
        return StreamingResponse(
            _chat_stream(serving, body, prepared, streams, created, model, tools),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    done = await serving.collect(request, streams)
    if done is None:
        return Response(status_code=499)
    (stream,) = done
    out = stream.last_output
    choices, completion_tokens = [], 0
    for c in out.outputs if out is not None else []:
        completion_tokens += len(c.token_ids)
        content, tool_calls = structured.tool_calls_from_output(tools, c.text)
        message = {"role": "assistant", "content": content, "refusal": None}
        if tool_calls:
            message["tool_calls"] = tool_calls
        finish = "abort" if stream.aborted else c.finish_reason
        choices.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": (
                    LogprobFormatter(serving.state.tokenizer).chat_logprobs(
                        c.token_ids, c.logprobs, body.top_logprobs or 0
                    )
                    if body.logprobs and c.logprobs is not None
                    else None
                ),
                "finish_reason": "tool_calls" if tool_calls and finish == "stop" else finish,
                "stop_reason": c.stop_reason,
            }
        )
    choices.sort(key=lambda c: c["index"])
    return JSONResponse(
        {
            "id": prepared.request_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": serving.usage(prepared, completion_tokens),
            **kv_transfer_response(done),
        }
    )


def _chat_stream(
    serving: OpenAIServing,
    body: ChatCompletionRequest,
    prepared: Prepared,
    streams: list[RequestStream],
    created: int,
    model: str,
    tools: structured.ToolPlan,
) -> AsyncIterator[str]:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    base = {"id": prepared.request_id, "object": "chat.completion.chunk", "created": created, "model": model}
    choices = {i: Choice(i) for i in range(body.n)}
    # Tool calls: the text of each choice is held back while it is (or may become) a tool call, and its
    # calls go out as tool_calls deltas when the choice finishes (clients accumulate them as OpenAI's).
    full_text: dict[int, str] = {}
    sent_content: dict[int, int] = {}

    chunk = ChunkEncoder(base, "delta", include_usage)

    def visible(index: int, new_text: str, finished: bool) -> tuple[str, list[dict]]:
        """(content to send now, tool calls to send now) for a choice with tools."""
        text = full_text[index] = full_text.get(index, "") + new_text
        sent = sent_content.get(index, 0)
        if finished:
            content, calls = structured.tool_calls_from_output(tools, text)
            content = (content or "")[sent:] if calls else text[sent:]
        else:
            safe = tools.parser.content_prefix_len(text) if tools.mode == "auto" else 0
            content, calls = text[sent : max(safe, sent)], []
        sent_content[index] = sent + len(content)
        return content, calls

    async def events() -> AsyncIterator[str]:
        for i in range(body.n):
            yield chunk(i, {"role": "assistant", "content": ""}, None, None)
        async for d in choice_deltas(streams, body.n, choices):
            logprobs = None
            if body.logprobs and d.logprobs is not None and d.token_ids:
                logprobs = LogprobFormatter(serving.state.tokenizer).chat_logprobs(
                    d.token_ids, d.logprobs, body.top_logprobs or 0
                )
            text, calls, finish = d.text, [], d.finish_reason
            if tools.mode != "none":
                text, calls = visible(d.index, d.text, d.finish_reason is not None)
                if calls and finish == "stop":
                    finish = "tool_calls"
            if calls:
                if text:
                    yield chunk(d.index, {"content": text}, logprobs, None)
                    text, logprobs = "", None
                for k, call in enumerate(calls):
                    yield chunk(d.index, {"tool_calls": [{"index": k, **call}]}, None, None)
            if not text and not finish and logprobs is None:
                continue
            yield chunk(d.index, {"content": text} if text else {}, logprobs, finish, d.stop_reason)

    return sse_stream(events(), streams, base, lambda tokens: serving.usage(prepared, tokens), choices, include_usage)

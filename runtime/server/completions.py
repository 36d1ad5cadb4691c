"""POST /v1/completions: prompts (text, token ids, or several), echo, logprobs in the completions shape, beam
search, one JSON body or an SSE stream (server/sse.py). The shared plumbing -- checks, tokenisation, sampling
parameters, submission, collection -- is OpenAIServing's (server/serving.py)."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.runtime.engine.async_engine import RequestStream
from kvserve.runtime.server import beam, structured
from kvserve.runtime.server.errors import bad_request
from kvserve.runtime.server.logprobs import LogprobFormatter
from kvserve.runtime.server.protocol import CompletionRequest
from kvserve.runtime.server.serving import OpenAIServing, Prepared, kv_transfer_response
from kvserve.runtime.server.sse import Choice, ChunkEncoder, choice_deltas, sse_stream


async def create_completion(serving: OpenAIServing, request: Request) -> Response:
    serving.check_auth(request)
    engine = serving.check_ready()
    body: CompletionRequest = await serving.parse(request, CompletionRequest)
    lora_name = await serving.check_model(body.model)
    if body.suffix:
        raise bad_request("suffix is not supported.", param="suffix")
    if body.max_tokens is not None and body.max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {body.max_tokens}.", param="max_tokens")
    serving.check_queue(engine)

    prompt = body.prompt
    if isinstance(prompt, str):
        raw_prompts: list[str | list[int]] = [prompt]
    elif prompt and isinstance(prompt[0], int):
        raw_prompts = [list(prompt)]
    else:
        raw_prompts = list(prompt)
    prompt_texts: list[str | None] = []
    prompt_ids: list[list[int]] = []
    for i, p in enumerate(raw_prompts):
        param = "prompt" if len(raw_prompts) == 1 else f"prompt.{i}"
        if isinstance(p, str):
            ids = await serving.encode(p, param)
            prompt_texts.append(p)
        else:
            serving.check_token_ids(p, param)
            ids = list(p)
            prompt_texts.append(None)
        if not ids:
            raise bad_request(f"{param} must not be empty.", param=param)
        prompt_ids.append(ids)
    spec = structured.output_spec(body)
    if body.use_beam_search:
        beam.check(body, body.logprobs, spec is not None)
        model = serving.state.config.served_model_names[0] if body.model is None else body.model
        return await beam.completion_response(
            serving, engine, request, body, prompt_texts, prompt_ids, lora_name, model, int(time.time())
        )
    params = [
        serving.sampling_params(
            body,
            body.max_tokens,
            body.logprobs,
            ids,
            "prompt" if len(prompt_ids) == 1 else f"prompt.{i}",
            spec,
            lora_name,
        )
        for i, ids in enumerate(prompt_ids)
    ]
    if spec is not None:
        compiled = await serving.compile_grammar(params[0])
        params = [dataclasses.replace(p, compiled_constraint=compiled.compiled_constraint) for p in params]
    prepared = Prepared(f"cmpl-{uuid.uuid4().hex}", prompt_texts, prompt_ids, params, body.n)
    if body.echo:
        for i, ids in enumerate(prompt_ids):
            if prompt_texts[i] is None:
                prompt_texts[i] = await serving._run_tokenizer(serving.state.tokenizer.decode, ids)
    streams = await serving.add_all(engine, prepared, request)
    created = int(time.time())
    model = serving.state.config.served_model_names[0] if body.model is None else body.model
    if body.stream:
        return StreamingResponse(
            _completion_stream(serving, body, prepared, streams, created, model),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    done = await serving.collect(request, streams)
    if done is None:
        return Response(status_code=499)  # nobody is listening (nginx's "client closed request")
    choices, completion_tokens = [], 0
    for i, stream in enumerate(done):
        out = stream.last_output
        for c in out.outputs if out is not None else []:
            completion_tokens += len(c.token_ids)
            echo = prepared.prompt_texts[i] if body.echo else ""
            choices.append(
                {
                    "index": i * body.n + c.index,
                    "text": echo + c.text,
                    "logprobs": (
                        LogprobFormatter(serving.state.tokenizer).completion_logprobs(
                            c.token_ids, c.logprobs, len(echo)
                        )
                        if body.logprobs is not None and c.logprobs is not None
                        else None
                    ),
                    "finish_reason": "abort" if stream.aborted else c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
    choices.sort(key=lambda c: c["index"])
    return JSONResponse(
        {
            "id": prepared.request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": serving.usage(prepared, completion_tokens),
            **kv_transfer_response(done),
        }
    )


def _completion_stream(
    serving: OpenAIServing,
    body: CompletionRequest,
    prepared: Prepared,
    streams: list[RequestStream],
    created: int,
    model: str,
) -> AsyncIterator[str]:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    base = {"id": prepared.request_id, "object": "text_completion", "created": created, "model": model}
    choices: dict[int, Choice] = {}
    chunk = ChunkEncoder(base, "text", include_usage)

    async def events() -> AsyncIterator[str]:
        if body.echo:
            for i, text in enumerate(prepared.prompt_texts):
                for j in range(body.n):
                    yield chunk(i * body.n + j, text or "", None, None)
        async for d in choice_deltas(streams, body.n, choices):
            logprobs = None
            if body.logprobs is not None and d.logprobs is not None and d.token_ids:
                logprobs = LogprobFormatter(serving.state.tokenizer).completion_logprobs(
                    d.token_ids, d.logprobs, d.text_offset
                )
            yield chunk(d.index, d.text, logprobs, d.finish_reason, d.stop_reason)

    return sse_stream(events(), streams, base, lambda tokens: serving.usage(prepared, tokens), choices, include_usage)

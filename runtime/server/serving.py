"""OpenAI-compatible request handling behind the routes: auth, validation (400 naming the field), model
name (404), queue depth (429), tokenisation off the event loop, engine submission, SSE streaming or
collection, logprobs and usage in OpenAI's shapes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from kvserve.runtime.engine.async_engine import AsyncEngine, RequestStream
from kvserve.runtime.errors import InvalidParameter, RequestFailedError
from kvserve.runtime.sampling_params import SamplingParams, verify_request
from kvserve.runtime.server import beam, lora_remote, structured
from kvserve.runtime.server.errors import APIError, bad_request, engine_error, find_invalid_text, from_validation_error
from kvserve.runtime.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from kvserve.runtime.tracing import trace_headers

if TYPE_CHECKING:
    from kvserve.runtime.server.state import ServerState

logger = logging.getLogger("kvserve.server")


@dataclass
class _Delta:
    """What one step added to one streamed choice."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list | None  # per new token
    text_offset: int  # characters of this choice sent before this delta
    finish_reason: str | None
    stop_reason: Any


@dataclass
class _Choice:
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


@dataclass
class _Prepared:
    request_id: str
    prompt_texts: list[str | None]
    prompt_ids: list[list[int]]
    params: list[Any]
    n: int


class OpenAIServing:
    def __init__(self, state: "ServerState"):
        self.state = state

    # ---- checks ---------------------------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        key = self.state.config.api_key
        if not key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(
                401,
                "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                type="invalid_request_error",
                code="invalid_api_key",
            )

    def check_ready(self) -> AsyncEngine:
        state = self.state
        if state.draining:
            raise APIError(
                503,
                "The server is shutting down (draining); retry on another replica.",
                type="server_error",
                code="service_unavailable",
                headers={"Connection": "close"},
            )
        if state.engine is None:
            raise APIError(
                503,
                "The model is still loading; retry shortly.",
                type="server_error",
                code="service_unavailable",
                headers={"Retry-After": "5"},
            )
        if not state.engine.is_running:
            raise APIError(
                503,
                "The engine is dead; this server is shutting down. Retry on another replica.",
                type="server_error",
                code="engine_dead",
            )
        return state.engine

    async def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter the request's `model` names (None: the base model); 404 for an unknown name (one
        the engine core does not serve either: it may have been loaded through another API server)."""
        names = self.state.config.served_model_names
        if model is None or model in names:
            return None
        if self.state.lora_enabled and await lora_remote.resolve(self.state, model):
            return model
        available = [*names, *lora_remote.served_adapters(self.state)]
        raise APIError(
            404,
            f"The model '{model}' does not exist. Available: {', '.join(available)}.",
            type="invalid_request_error",
            param="model",
            code="model_not_found",
        )

    def check_queue(self, engine: AsyncEngine) -> None:
        limit = self.state.config.max_queue_len
        if limit is not None and engine.num_waiting >= limit:
            raise APIError(
                429,
                f"Server is at capacity: {engine.num_waiting} requests waiting (--max-queue-len {limit}). Retry later.",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(self.state.config.retry_after_s)},
            )

    async def parse(self, request: Request, model_cls: type) -> Any:
        limit = self.state.config.max_request_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise APIError(413, f"Request body larger than {limit} bytes.", code="request_too_large")
        parts, size = [], 0
        async for part in request.stream():  # bounded read: a chunked upload has no Content-Length
            size += len(part)
            if size > limit:
                raise APIError(413, f"Request body larger than {limit} bytes.", code="request_too_large")
            parts.append(part)
        body = b"".join(parts)
        context = {"max_model_len": self.state.max_model_len}
        if len(body) <= _PARSE_INLINE_BYTES:
            return _parse_body(body, model_cls, context)
        # Parsing and validating a large body takes milliseconds per MiB: off the event loop, so /health and
        # other clients' streams keep flowing meanwhile (the thread yields the GIL every switch interval).
        return await asyncio.get_running_loop().run_in_executor(
            self.state.parse_pool, _parse_body, body, model_cls, context
        )

    # ---- tokenization (one dedicated thread) ---------------------------------------------------------
    async def _run_tokenizer(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.state.tokenize_pool, fn, *args)

    def _guard_length(self, text: str, param: str) -> None:
        """Reject absurdly long text without tokenizing it: each token covers at most max_token_chars
        characters, so with this many characters the prompt cannot fit (x4 margin for normalizers)."""
        limit = self.state.max_model_len * self.state.max_token_chars * 4
        if len(text) > limit:
            raise bad_request(
                f"{param} is too long: {len(text)} characters cannot fit in this model's maximum "
                f"context length of {self.state.max_model_len} tokens.",
                param=param,
                code="context_length_exceeded",
            )

    async def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        self._guard_length(text, param)
        tokenizer = self.state.tokenizer
        return await self._run_tokenizer(lambda: tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def render_chat(self, messages: list, add_generation_prompt: bool, tools: list | None = None) -> str:
        conversation = [m.template_dict() for m in messages]
        for i, m in enumerate(conversation):
            self._guard_length(m["content"], f"messages.{i}.content")
        tokenizer, template = self.state.tokenizer, self.state.chat_template

        def render() -> str:
            return tokenizer.apply_chat_template(
                conversation,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                tools=tools or None,
            )

        try:
            return await self._run_tokenizer(render)
        except Exception as exc:  # template errors are the request's fault (e.g. roles it cannot render)
            raise bad_request(
                f"messages could not be rendered with the chat template: {exc}", param="messages"
            ) from None

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.state.limits.vocab_size
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise bad_request(
                f"{param} contains token ids outside the vocabulary (size {vocab}): {bad[:5]}", param=param
            )

    # ---- shared request plumbing ---------------------------------------------------------------------
    def sampling_params(
        self,
        body: Any,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_ids: list[int],
        prompt_param: str = "prompt",
        structured: Any = None,
        lora_name: str | None = None,
    ) -> SamplingParams:
        """The request's SamplingParams, checked against this engine exactly as the engine (and the offline
        LLM) checks them (sampling_params.verify_request): a 400 naming the field, before the engine sees it."""
        if max_tokens is None:
            max_tokens = max(1, self.state.max_model_len - len(prompt_ids))
        if body.best_of is not None and body.best_of != body.n:
            raise bad_request("best_of is not supported unless it equals n.", param="best_of")
        if body.logit_bias:
            raise bad_request("logit_bias is not supported.", param="logit_bias")
        kwargs = dict(
            n=body.n,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k is None else body.top_k,
            min_p=body.min_p or 0.0,
            seed=body.seed,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            structured_outputs=structured,
            lora_name=lora_name,
        )
        try:
            params = SamplingParams(**kwargs)
            verify_request(prompt_ids, params, self.state.limits, prompt_param)
        except (ValueError, TypeError) as exc:  # InvalidParameter names the field
            code = "context_length_exceeded" if "maximum context length" in str(exc) else None
            raise bad_request(str(exc), param=getattr(exc, "param", None), code=code) from None
        return params

    async def compile_grammar(self, params: Any) -> Any:
        """Attach the compiled grammar (in the grammar thread: a slow schema delays only this request)."""
        if params.structured_outputs is None:
            return params
        compiler = self.state.grammar_compiler
        try:
            compiled = await asyncio.get_running_loop().run_in_executor(
                self.state.grammar_pool, compiler.compile, params.structured_outputs
            )
        except InvalidParameter as exc:
            raise bad_request(str(exc), param=exc.param) from None
        return dataclasses.replace(params, compiled_constraint=compiled)

    async def add_all(self, engine: AsyncEngine, prepared: _Prepared, request: Request) -> list[RequestStream]:
        streams: list[RequestStream] = []
        headers = trace_headers(request.headers, enabled=engine.tracer is not None)
        try:
            for i, (ids, params) in enumerate(zip(prepared.prompt_ids, prepared.params)):
                sub_id = prepared.request_id if len(prepared.prompt_ids) == 1 else f"{prepared.request_id}-{i}"
                streams.append(await engine.add_request(sub_id, ids, params, trace_headers=headers))
                if params.lora_name is not None and self.state.metrics is not None:
                    self.state.metrics.observe_lora_request(params.lora_name)
        except BaseException as exc:
            for stream in streams:
                stream.abort()
            if isinstance(exc, RequestFailedError):
                raise engine_error(exc) from None
            if isinstance(exc, ValueError):
                raise bad_request(str(exc), param=getattr(exc, "param", None) or "prompt") from None
            raise
        return streams

    async def collect(self, request: Request, streams: list[RequestStream]) -> list[Any] | None:
        """Run every stream to its end; abort them all and return None if the client disconnects meanwhile."""

        async def drain(stream: RequestStream) -> Any:
            async for _ in stream:
                pass
            return stream

        task = asyncio.ensure_future(asyncio.gather(*(drain(s) for s in streams)))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no "never retrieved" log
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    logger.info("client disconnected; aborting %s", [s.request_id for s in streams])
                    task.cancel()
                    return None
        except RequestFailedError as exc:
            raise engine_error(exc) from None
        finally:
            if not task.done():
                task.cancel()
            for stream in streams:
                stream.abort()

    @staticmethod
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

    def usage(self, prepared: _Prepared, completion_tokens: int) -> dict[str, int]:
        prompt_tokens = sum(len(ids) for ids in prepared.prompt_ids)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def token_text(self, token_id: int, logprob_entry: Any) -> str:
        decoded = getattr(logprob_entry, "decoded_token", None)
        if decoded is None:
            decoded = self.state.tokenizer.decode([token_id])
        return decoded

    def _entries(self, logprob_dict: dict) -> list[tuple[int, Any]]:
        return sorted(logprob_dict.items(), key=lambda kv: (getattr(kv[1], "rank", 0) or 0, -kv[1].logprob))

    def completion_logprobs(self, token_ids: list[int], logprobs: list[dict], offset: int) -> dict[str, Any]:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, logprobs):
            sampled = entry.get(token_id)
            text = self.token_text(token_id, sampled)
            tokens.append(text)
            token_logprobs.append(None if sampled is None else _finite(sampled.logprob))
            top_entry: dict[str, float] = {}
            for t, lp in self._entries(entry):  # best first; distinct ids may decode alike: keep the better
                top_entry.setdefault(self.token_text(t, lp), _finite(lp.logprob))
            top.append(top_entry)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def chat_logprobs(self, token_ids: list[int], logprobs: list[dict], top_n: int) -> dict[str, Any]:
        content = []
        for token_id, entry in zip(token_ids, logprobs):
            sampled = entry.get(token_id)
            text = self.token_text(token_id, sampled)
            tops = [
                {
                    "token": (s := self.token_text(t, lp)),
                    "logprob": _finite(lp.logprob),
                    "bytes": list(s.encode("utf-8")),
                }
                for t, lp in self._entries(entry)[:top_n]
            ]
            content.append(
                {
                    "token": text,
                    "logprob": None if sampled is None else _finite(sampled.logprob),
                    "bytes": list(text.encode("utf-8")),
                    "top_logprobs": tops,
                }
            )
        return {"content": content, "refusal": None}

    # ---- /v1/completions ------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        self.check_auth(request)
        engine = self.check_ready()
        body: CompletionRequest = await self.parse(request, CompletionRequest)
        lora_name = await self.check_model(body.model)
        if body.suffix:
            raise bad_request("suffix is not supported.", param="suffix")
        if body.max_tokens is not None and body.max_tokens < 1:
            raise bad_request(f"max_tokens must be at least 1, got {body.max_tokens}.", param="max_tokens")
        self.check_queue(engine)

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
                ids = await self.encode(p, param)
                prompt_texts.append(p)
            else:
                self.check_token_ids(p, param)
                ids = list(p)
                prompt_texts.append(None)
            if not ids:
                raise bad_request(f"{param} must not be empty.", param=param)
            prompt_ids.append(ids)
        spec = structured.output_spec(body)
        if body.use_beam_search:
            beam.check(body, body.logprobs, spec is not None)
            model = self.state.config.served_model_names[0] if body.model is None else body.model
            return await beam.completion_response(
                self, engine, request, body, prompt_texts, prompt_ids, lora_name, model, int(time.time())
            )
        params = [
            self.sampling_params(
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
            compiled = await self.compile_grammar(params[0])
            params = [dataclasses.replace(p, compiled_constraint=compiled.compiled_constraint) for p in params]
        prepared = _Prepared(f"cmpl-{uuid.uuid4().hex}", prompt_texts, prompt_ids, params, body.n)
        if body.echo:
            for i, ids in enumerate(prompt_ids):
                if prompt_texts[i] is None:
                    prompt_texts[i] = await self._run_tokenizer(self.state.tokenizer.decode, ids)
        streams = await self.add_all(engine, prepared, request)
        created = int(time.time())
        model = self.state.config.served_model_names[0] if body.model is None else body.model
        if body.stream:
            return StreamingResponse(
                self._completion_stream(body, prepared, streams, created, model),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        done = await self.collect(request, streams)
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
                            self.completion_logprobs(c.token_ids, c.logprobs, len(echo))
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
                "usage": self.usage(prepared, completion_tokens),
            }
        )

    async def _choice_deltas(
        self, streams: list[RequestStream], n: int, choices: dict[int, _Choice]
    ) -> AsyncIterator[_Delta]:
        """What each engine step added to each choice (choice index = prompt index * n + sample index). A
        delta per step with new tokens, even when their text is held back (a partial UTF-8 character, a
        possible stop string) and the text is "": clients see every token's timing (ITL), as with vLLM.
        Choices cut off by a drain timeout end with an "abort" delta."""
        async for i, out in self.merged(streams):
            if out is None:
                if streams[i].aborted:
                    for k in range(n):
                        ch = choices.setdefault(i * n + k, _Choice(i * n + k))
                        if ch.finish_reason is None:
                            ch.finish_reason = "abort"
                            yield _Delta(ch.index, "", [], None, ch.sent_text_len, "abort", None)
                continue
            for c in out.outputs:
                ch = choices.setdefault(i * n + c.index, _Choice(i * n + c.index))
                if ch.finish_reason is not None:
                    continue
                ch.num_tokens = len(c.token_ids)
                text = c.text[ch.sent_text_len :]
                new_ids = c.token_ids[ch.sent_tokens :]
                if not text and not c.finish_reason and not new_ids:
                    continue
                logprobs = c.logprobs[ch.sent_tokens :] if c.logprobs is not None else None
                delta = _Delta(
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

    async def _sse_stream(
        self,
        events: AsyncIterator[str],
        streams: list[RequestStream],
        base: dict,
        prepared: _Prepared,
        choices: dict[int, _Choice],
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
                yield _sse({**base, "choices": [], "usage": self.usage(prepared, completion_tokens)})
        except RequestFailedError as exc:
            yield _sse(engine_error(exc).body())
        finally:
            for stream in streams:
                stream.abort()
        yield "data: [DONE]\n\n"

    def _completion_stream(
        self, body: CompletionRequest, prepared: _Prepared, streams: list[RequestStream], created: int, model: str
    ) -> AsyncIterator[str]:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        base = {"id": prepared.request_id, "object": "text_completion", "created": created, "model": model}
        choices: dict[int, _Choice] = {}
        chunk = _ChunkEncoder(base, "text", include_usage)

        async def events() -> AsyncIterator[str]:
            if body.echo:
                for i, text in enumerate(prepared.prompt_texts):
                    for j in range(body.n):
                        yield chunk(i * body.n + j, text or "", None, None)
            async for d in self._choice_deltas(streams, body.n, choices):
                logprobs = None
                if body.logprobs is not None and d.logprobs is not None and d.token_ids:
                    logprobs = self.completion_logprobs(d.token_ids, d.logprobs, d.text_offset)
                yield chunk(d.index, d.text, logprobs, d.finish_reason, d.stop_reason)

        return self._sse_stream(events(), streams, base, prepared, choices, include_usage)

    # ---- /v1/chat/completions ---------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        self.check_auth(request)
        engine = self.check_ready()
        body: ChatCompletionRequest = await self.parse(request, ChatCompletionRequest)
        lora_name = await self.check_model(body.model)
        tools = structured.tool_plan(body, self.state.config.tool_call_parser)
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
        self.check_queue(engine)

        text = await self.render_chat(body.messages, body.add_generation_prompt, tools.tools)
        ids = await self.encode(text, "messages", add_special_tokens=False)
        if not ids:
            raise bad_request("messages rendered to an empty prompt.", param="messages")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if body.use_beam_search:
            beam.check(body, logprobs, spec is not None)
            model = self.state.config.served_model_names[0] if body.model is None else body.model
            return await beam.chat_response(
                self, engine, request, body, ids, max_tokens, lora_name, model, int(time.time())
            )
        params = await self.compile_grammar(
            self.sampling_params(body, max_tokens, logprobs, ids, "messages", spec, lora_name)
        )
        prepared = _Prepared(f"chatcmpl-{uuid.uuid4().hex}", [text], [ids], [params], body.n)
        streams = await self.add_all(engine, prepared, request)
        created = int(time.time())
        model = self.state.config.served_model_names[0] if body.model is None else body.model
        if body.stream:
            return StreamingResponse(
                self._chat_stream(body, prepared, streams, created, model, tools),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        done = await self.collect(request, streams)
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
                        self.chat_logprobs(c.token_ids, c.logprobs, body.top_logprobs or 0)
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
                "usage": self.usage(prepared, completion_tokens),
            }
        )

    def _chat_stream(
        self,
        body: ChatCompletionRequest,
        prepared: _Prepared,
        streams: list[RequestStream],
        created: int,
        model: str,
        tools: structured.ToolPlan,
    ) -> AsyncIterator[str]:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        base = {"id": prepared.request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        choices = {i: _Choice(i) for i in range(body.n)}
        # Tool calls: the text of each choice is held back while it is (or may become) a tool call, and its
        # calls go out as tool_calls deltas when the choice finishes (clients accumulate them as OpenAI's).
        full_text: dict[int, str] = {}
        sent_content: dict[int, int] = {}

        chunk = _ChunkEncoder(base, "delta", include_usage)

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
            async for d in self._choice_deltas(streams, body.n, choices):
                logprobs = None
                if body.logprobs and d.logprobs is not None and d.token_ids:
                    logprobs = self.chat_logprobs(d.token_ids, d.logprobs, body.top_logprobs or 0)
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

        return self._sse_stream(events(), streams, base, prepared, choices, include_usage)

    # ---- /tokenize, /detokenize -----------------------------------------------------------------------
    async def tokenize(self, request: Request) -> JSONResponse:
        self.check_auth(request)
        self.check_ready()
        body: TokenizeRequest = await self.parse(request, TokenizeRequest)
        await self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("Give exactly one of prompt or messages.", param="prompt")
        if body.messages is not None:
            if not body.messages:
                raise bad_request("messages must not be empty.", param="messages")
            text = await self.render_chat(body.messages, body.add_generation_prompt)
            ids = await self.encode(text, "messages", add_special_tokens=False)
        else:
            ids = await self.encode(body.prompt, "prompt", add_special_tokens=body.add_special_tokens)
        return JSONResponse({"count": len(ids), "max_model_len": self.state.max_model_len, "tokens": ids})

    async def detokenize(self, request: Request) -> JSONResponse:
        self.check_auth(request)
        self.check_ready()
        body: DetokenizeRequest = await self.parse(request, DetokenizeRequest)
        await self.check_model(body.model)
        self.check_token_ids(body.tokens, "tokens")
        text = await self._run_tokenizer(self.state.tokenizer.decode, body.tokens)
        return JSONResponse({"prompt": text})


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # the only way JSON text can hold a lone surrogate
_PARSE_INLINE_BYTES = 64 * 1024  # bodies up to this size are parsed on the event loop (sub-millisecond)


def _parse_body(body: bytes, model_cls: type, context: dict | None = None) -> Any:
    """JSON -> the request model; every failure is a 400 naming the field (no Python reprs)."""
    try:
        data = json.loads(body)
    except UnicodeDecodeError:
        raise bad_request("Request body is not valid UTF-8.", code="invalid_json") from None
    except ValueError as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise bad_request("Request body is nested too deeply.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("Request body must be a JSON object.", code="invalid_json")
    bad_text = find_invalid_text(data) if _SURROGATE_ESCAPE.search(body) else None
    if bad_text is not None:
        raise bad_request(
            f"{bad_text or 'a key'}: text is not valid Unicode (it holds a lone surrogate escape such as \\ud800).",
            param=bad_text or None,
            code="invalid_value",
        )
    try:
        return model_cls.model_validate(data, context=context)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


_JSON = json.JSONEncoder(ensure_ascii=False)  # what json.dumps(..., ensure_ascii=False) builds on every call


def _sse(payload: dict) -> str:
    return f"data: {_JSON.encode(payload)}\n\n"


def _json_value(value: Any) -> str:
    return "null" if value is None else _JSON.encode(value)


class _ChunkEncoder:
    """One streamed choice chunk as SSE: byte for byte `_sse({**base, "choices": [{"index": i, field: value,
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


def _finite(value: float) -> float:
    # JSON has no -inf; OpenAI clients expect numbers. -9999.0 is what OpenAI itself returns for "impossible".
    return value if value > -1e30 else -9999.0

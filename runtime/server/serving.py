"""The request plumbing both OpenAI endpoints share (server/completions.py, server/chat.py): auth, body
parsing and validation (400 naming the field), model name (404), queue depth (429), tokenisation off the
event loop, sampling parameters (only the fields a client set), grammar compilation, submission to the
engine, collection, usage; and /tokenize, /detokenize. SSE lives in server/sse.py, logprob shapes in
server/logprobs.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from kvserve.runtime.engine.async_engine import AsyncEngine, RequestStream
from kvserve.runtime.engine.front import PreparedRequest, verify
from kvserve.runtime.errors import InvalidParameter, RequestFailedError
from kvserve.runtime.sampling_params import SamplingParams
from kvserve.runtime.server import lora_remote
from kvserve.runtime.server.errors import APIError, bad_request, engine_error, find_invalid_text, from_validation_error
from kvserve.runtime.server.protocol import DetokenizeRequest, TokenizeRequest
from kvserve.runtime.tracing import trace_headers

if TYPE_CHECKING:
    from kvserve.runtime.server.state import ServerState

logger = logging.getLogger("kvserve.server")

# Request fields that map one to one onto a SamplingParams field of the same name.
SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "skip_special_tokens",
    "include_stop_str_in_output",
)


def client_sampling_fields(body: Any) -> dict[str, Any]:
    """The sampling fields the client set (an explicit null counts as unset): SamplingParams is the one home
    of the defaults, so the server never restates them."""
    return {
        name: getattr(body, name)
        for name in SAMPLING_FIELDS
        if name in body.model_fields_set and getattr(body, name) is not None
    }


def kv_transfer_response(done: list) -> dict:
    """P/D (vLLM's response field): a prefill engine's kv_transfer_params, from the first prompt's output;
    {} when the request had none to return, so the response stays as it was."""
    out = done[0].last_output if done else None
    params = out.kv_transfer_params if out is not None else None
    return {} if params is None else {"kv_transfer_params": params}


@dataclass
class Prepared:
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
        kwargs = client_sampling_fields(body)  # the rest: SamplingParams' own defaults
        kwargs.update(max_tokens=max_tokens, logprobs=logprobs, structured_outputs=structured, lora_name=lora_name)
        if body.kv_transfer_params is not None:  # P/D (docs/disaggregation.md); SamplingParams checks it
            kwargs["kv_transfer_params"] = body.kv_transfer_params
        try:
            params = SamplingParams(**kwargs)
            verify(prompt_ids, params, self.state.limits, prompt_param)  # the front's one verification
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

    async def add_all(self, engine: AsyncEngine, prepared: Prepared, request: Request) -> list[RequestStream]:
        streams: list[RequestStream] = []
        headers = trace_headers(request.headers, enabled=engine.tracer is not None)
        try:
            for i, (ids, params) in enumerate(zip(prepared.prompt_ids, prepared.params)):
                sub_id = prepared.request_id if len(prepared.prompt_ids) == 1 else f"{prepared.request_id}-{i}"
                request = PreparedRequest(None, ids, params)  # verified and compiled above
                streams.append(await engine.add_request(sub_id, request, params, trace_headers=headers))
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

    def usage(self, prepared: Prepared, completion_tokens: int) -> dict[str, int]:
        prompt_tokens = sum(len(ids) for ids in prepared.prompt_ids)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

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

"""`use_beam_search` on /v1/completions and /v1/chat/completions (vLLM's extra fields: `n` is the beam width,
`length_penalty`, plus HF's `early_stopping`). The search itself is engine/beam_search.py; here: what the
request may combine with it (400 naming the field otherwise), one 1-token engine request per live beam per
step, and the response (one choice per returned beam, best first). No streaming: a beam's text is only
final when the search ends (vLLM streams none either)."""

from __future__ import annotations

import uuid
from typing import Any

from kvserve.runtime.engine.beam_search import BeamSearch, BeamSearchParams, run_async, top_logprobs
from kvserve.runtime.errors import InvalidParameter, RequestFailedError
from kvserve.runtime.sampling_params import SamplingParams
from kvserve.runtime.server.errors import bad_request, engine_error


class ClientGone(Exception):
    """The client disconnected mid-search: its in-flight step requests were aborted."""


def check(body: Any, logprobs: int | None, structured: bool) -> None:
    """What beam search cannot combine with, each a 400 naming the field."""
    if body.stream:
        raise bad_request("stream is not supported with use_beam_search.", param="stream")
    if body.temperature not in (None, 0, 0.0):
        raise bad_request("use_beam_search is deterministic: temperature must be 0 or unset.", param="temperature")
    if logprobs is not None:
        raise bad_request("logprobs are not supported with use_beam_search.", param="logprobs")
    if structured:
        raise bad_request("structured outputs are not supported with use_beam_search.", param="use_beam_search")


def params_for(body: Any, max_tokens: int | None, max_model_len: int, prompt_len: int) -> BeamSearchParams:
    room = max_model_len - prompt_len
    try:
        return BeamSearchParams(
            beam_width=body.n,
            max_tokens=min(max_tokens, room) if max_tokens is not None else room,
            ignore_eos=body.ignore_eos,
            length_penalty=body.length_penalty,
            early_stopping=body.early_stopping,
        )
    except InvalidParameter as exc:
        raise bad_request(str(exc), param=exc.param) from None


async def search(
    engine: Any,
    request: Any,
    prompt_ids: list[list[int]],
    params: list[BeamSearchParams],
    eos_token_ids: frozenset[int],
    lora_name: str | None,
) -> list[BeamSearch]:
    """Run one search per prompt to its end through the async engine."""
    searches = [BeamSearch(p, eos_token_ids) for p in params]
    base = f"beam-{uuid.uuid4().hex}"
    counter = iter(range(1 << 62))

    async def next_token_logprobs(ids: list[int], num: int) -> list[tuple[int, float]]:
        if await request.is_disconnected():
            raise ClientGone
        step = SamplingParams(max_tokens=1, temperature=0, logprobs=num, ignore_eos=True, lora_name=lora_name)
        try:
            stream = await engine.add_request(f"{base}-{next(counter)}", ids, step)
            async for _ in stream:
                pass
        except RequestFailedError as exc:
            raise engine_error(exc) from None
        out = stream.last_output
        if out is None or stream.aborted or not out.outputs[0].logprobs:
            raise engine_error(RequestFailedError("beam search step was aborted", retryable=True))
        return top_logprobs(out.outputs[0].logprobs[0], num)

    await run_async(searches, prompt_ids, next_token_logprobs)
    return searches


async def _run(serving: Any, engine: Any, request: Any, body: Any, prompt_ids, max_tokens, lora_name):
    state = serving.state
    params = [params_for(body, max_tokens, state.max_model_len, len(ids)) for ids in prompt_ids]
    try:
        searches = await search(engine, request, prompt_ids, params, state.eos_token_ids, lora_name)
    except ClientGone:
        return None
    decode = state.tokenizer.decode
    beams = []
    for s in searches:
        texts = [
            await serving._run_tokenizer(lambda t=h.token_ids: decode(t, skip_special_tokens=True)) for h in s.results()
        ]
        beams.append(list(zip(s.results(), texts)))
    return beams


def _usage(prompt_ids: list[list[int]], beams) -> dict[str, int]:
    prompt_tokens = sum(len(ids) for ids in prompt_ids)
    completion = sum(len(h.token_ids) for per_prompt in beams for h, _ in per_prompt)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


async def completion_response(
    serving, engine, request, body, prompt_texts, prompt_ids, lora_name, model: str, created: int
):
    from fastapi.responses import JSONResponse, Response

    beams = await _run(serving, engine, request, body, prompt_ids, body.max_tokens, lora_name)
    if beams is None:
        return Response(status_code=499)
    choices = []
    for i, per_prompt in enumerate(beams):
        echo = prompt_texts[i] or "" if body.echo else ""
        for j, (h, text) in enumerate(per_prompt):
            choices.append(
                {
                    "index": i * body.n + j,
                    "text": echo + text,
                    "logprobs": None,
                    "finish_reason": h.finish_reason,
                    "stop_reason": None,
                }
            )
    return JSONResponse(
        {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": _usage(prompt_ids, beams),
        }
    )


async def chat_response(serving, engine, request, body, ids, max_tokens, lora_name, model: str, created: int):
    from fastapi.responses import JSONResponse, Response

    beams = await _run(serving, engine, request, body, [ids], max_tokens, lora_name)
    if beams is None:
        return Response(status_code=499)
    choices = [
        {
            "index": j,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": None,
            "finish_reason": h.finish_reason,
            "stop_reason": None,
        }
        for j, (h, text) in enumerate(beams[0])
    ]
    return JSONResponse(
        {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": _usage([ids], beams),
        }
    )

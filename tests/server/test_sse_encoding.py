"""The streamed chunk encoder (server/sse.py's ChunkEncoder) gives byte for byte what json.dumps of the whole chunk
gave before it: the wire format of /v1/completions and /v1/chat/completions streams is unchanged."""

from __future__ import annotations

import json
import random

import pytest

from kvserve.runtime.server.sse import ChunkEncoder as _ChunkEncoder
from kvserve.runtime.server.sse import sse as _sse


def _reference(base: dict, field: str, include_usage: bool, index, value, logprobs, finish, stop_reason) -> str:
    payload = {
        **base,
        "choices": [
            {"index": index, field: value, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop_reason}
        ],
    }
    if include_usage:
        payload["usage"] = None
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


TEXTS = [
    "",
    "hello",
    " world",
    'quote " and \\ backslash',
    "tab\tnew\nline",
    "\u00e9\u4e2d\U0001f600",
    "\x00\x1f",
    "\u2028\u2029",
    "</script>",
]


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("field", ["text", "delta"])
def test_chunk_encoder_is_byte_identical(field, include_usage):
    rng = random.Random(0)
    base = {
        "id": "cmpl-0123abcd",
        "object": "text_completion" if field == "text" else "chat.completion.chunk",
        "created": 1764633600,
        "model": 'm\u00f6del "x"',
    }
    encode = _ChunkEncoder(base, field, include_usage)
    logprobs_values = [
        None,
        {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{"a": -0.5}], "text_offset": [3]},
        {"content": [], "refusal": None},
    ]
    for _ in range(500):
        text = rng.choice(TEXTS) + rng.choice(TEXTS)
        value = (
            text
            if field == "text"
            else rng.choice(
                [
                    {},
                    {"content": text},
                    {"role": "assistant", "content": ""},
                    {
                        "tool_calls": [
                            {"index": 0, "id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                        ]
                    },
                ]
            )
        )
        args = (
            rng.randrange(0, 20),
            value,
            rng.choice(logprobs_values),
            rng.choice([None, "stop", "length", "abort"]),
            rng.choice([None, 7, "</s>", "\u00e9"]),
        )
        got = encode(*args)
        assert got == _reference(base, field, include_usage, *args)
        assert got.encode("utf-8") == _reference(base, field, include_usage, *args).encode("utf-8")


def test_sse_matches_json_dumps():
    payload = {"id": "x", "choices": [], "usage": {"prompt_tokens": 1}, "t": '\u00e9"', "f": -9999.0}
    assert _sse(payload) == f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

"""Real responses validate against OpenAI's published OpenAPI schemas (vendored in openai_schemas.json, with
its source commit): completions, chat completions (plain, logprobs, tool calls), stream chunks, the models
list and error bodies. Strict clients generated from that description reject what does not."""

from __future__ import annotations

import json
import pathlib

import httpx
import pytest
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from tests.server.conftest import STORIES_DIR, LiveServer, make_engine


def _nullable(node):
    """OpenAPI's `nullable: true` (still used in parts of the 3.1 document) is not JSON Schema: spell it as
    the JSON Schema it means (null added to `type` and `enum`)."""
    if isinstance(node, list):
        return [_nullable(x) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: _nullable(v) for k, v in node.items()}
    if node.pop("nullable", False):
        if "type" in node:
            node["type"] = [node["type"], "null"] if isinstance(node["type"], str) else [*node["type"], "null"]
        if "enum" in node:
            node["enum"] = [*node["enum"], None]
        if "$ref" in node or "allOf" in node or "anyOf" in node:
            node = {"anyOf": [node, {"type": "null"}]}
    return node


SCHEMAS = _nullable(json.loads((pathlib.Path(__file__).parent / "openai_schemas.json").read_text()))
ROOT = "urn:openai-openapi"
REGISTRY = Registry().with_resource(ROOT, Resource.opaque(SCHEMAS))


def validate(instance: dict, name: str) -> None:
    schema = {"$ref": f"{ROOT}#/components/schemas/{name}"}
    errors = sorted(Draft202012Validator(schema, registry=REGISTRY).iter_errors(instance), key=str)
    assert not errors, f"{name}: {errors[0].message} at {list(errors[0].absolute_path)}"


@pytest.fixture(scope="module")
def base_url():
    server = LiveServer(
        make_engine(str(STORIES_DIR), kv_cache_bytes=4 << 20, max_num_seqs=8, max_model_len=256),
        served_model_names=["stories260K"],
        model_dir=str(STORIES_DIR),
    )
    yield server.base_url
    server.stop()


def _sse(client: httpx.Client, path: str, body: dict) -> list[dict]:
    events = []
    with client.stream("POST", path, json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_the_validator_is_live():
    with pytest.raises(AssertionError):
        validate(
            {
                "id": "x",
                "object": "chat.completion",
                "created": 1,
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "logprobs": None,
                        "message": {"role": "assistant", "content": "hi"},
                    }
                ],
            },
            "CreateChatCompletionResponse",
        )


def test_responses_match_openais_schemas(base_url):
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "required": ["x"],
                "additionalProperties": False,
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
            },
        },
    }
    chat = {"model": "stories260K", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    with httpx.Client(base_url=base_url, timeout=60) as client:
        validate(client.get("/v1/models").json(), "ListModelsResponse")
        validate(
            client.post(
                "/v1/completions", json={"model": "stories260K", "prompt": "Once", "max_tokens": 8, "logprobs": 2}
            ).json(),
            "CreateCompletionResponse",
        )
        validate(
            client.post("/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 2}).json(),
            "CreateChatCompletionResponse",
        )
        called = client.post(
            "/v1/chat/completions",
            json={**chat, "max_tokens": 40, "tools": [tool], "tool_choice": "required", "parallel_tool_calls": False},
        )
        assert called.json()["choices"][0]["finish_reason"] == "tool_calls"
        validate(called.json(), "CreateChatCompletionResponse")
        chunks = _sse(
            client,
            "/v1/chat/completions",
            {**chat, "stream": True, "logprobs": True, "stream_options": {"include_usage": True}},
        )
        chunks += _sse(
            client,
            "/v1/chat/completions",
            {
                **chat,
                "max_tokens": 40,
                "stream": True,
                "tools": [tool],
                "tool_choice": "required",
                "parallel_tool_calls": False,
            },
        )
        assert any(c["choices"] and c["choices"][0]["delta"].get("tool_calls") for c in chunks)
        for c in chunks:
            validate(c, "CreateChatCompletionStreamResponse")
        error = client.post("/v1/chat/completions", json={**chat, "max_tokens": -1})
        assert error.status_code == 400
        validate(error.json(), "ErrorResponse")

"""Structured outputs and tool calling through the OpenAI client against a live server on stories260K:
response_format json_object / json_schema (and the client's `parse()` helper), vLLM's structured_outputs
and guided_* extensions, tools with tool_choice required / named / none / auto, streamed tool-call deltas,
and 400s naming the field for what cannot be served."""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest

from tests.server.conftest import STORIES_DIR, LiveServer, make_engine

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city", "unit"],
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["zone"],
            "properties": {"zone": {"type": "string", "maxLength": 6}},
        },
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def srv():
    server = LiveServer(
        make_engine(str(STORIES_DIR), kv_cache_bytes=8 << 20, max_num_seqs=16, max_model_len=512),
        served_model_names=["stories260K"],
        model_dir=str(STORIES_DIR),
        tool_call_parser="hermes",
    )
    yield server
    server.stop()


def test_response_format_json_schema_and_parse_helper(srv):
    client = srv.openai()

    class Pet(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str = pydantic.Field(max_length=10)
        legs: int = pydantic.Field(ge=0, le=8)

    parsed = client.chat.completions.parse(
        model="stories260K", messages=MESSAGES, response_format=Pet, max_tokens=80, temperature=0
    )
    assert isinstance(parsed.choices[0].message.parsed, Pet)
    resp = client.chat.completions.create(
        model="stories260K",
        messages=MESSAGES,
        max_tokens=80,
        temperature=0.7,
        seed=1,
        n=2,
        response_format={"type": "json_object"},
    )
    for choice in resp.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
    assert resp.choices[0].message.refusal is None


def test_vllm_extensions_on_completions(srv):
    client = srv.openai()
    schema = {
        "type": "object",
        "required": ["n"],
        "additionalProperties": False,
        "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
    }
    out = client.completions.create(
        model="stories260K",
        prompt="Once upon a time",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"json": schema}},
    )
    jsonschema.validate(json.loads(out.choices[0].text), schema)
    out = client.completions.create(
        model="stories260K",
        prompt="The cat was",
        max_tokens=8,
        temperature=1.0,
        extra_body={"guided_choice": ["big", "small"]},
        n=3,
        seed=4,
    )
    assert {c.text for c in out.choices} <= {"big", "small"}
    out = client.completions.create(
        model="stories260K",
        prompt="The cat was",
        max_tokens=8,
        temperature=0,
        extra_body={"guided_regex": "[0-9]{3}"},
        stream=True,
    )
    assert len("".join(c.choices[0].text for c in out if c.choices)) == 3


def test_tool_choice_required_and_named(srv):
    client = srv.openai()
    resp = client.chat.completions.create(
        model="stories260K",
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=120,
        temperature=0.8,
        seed=2,
        parallel_tool_calls=False,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.id.startswith("call_") and call.type == "function"

    resp = client.chat.completions.create(
        model="stories260K",
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=60,
        temperature=0,
    )
    (call,) = resp.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])

    # The history may carry the call and the tool's answer.
    follow = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
    ]
    resp = client.chat.completions.create(
        model="stories260K", messages=follow, tools=[WEATHER, TIME], tool_choice="none", max_tokens=8, temperature=0
    )
    assert resp.choices[0].message.tool_calls is None and resp.choices[0].message.content


def test_streamed_tool_calls_accumulate_like_openai(srv):
    client = srv.openai()
    stream = client.chat.completions.create(
        model="stories260K",
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=120,
        temperature=0,
        stream=True,
        parallel_tool_calls=False,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.content
            for tc in choice.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


@pytest.mark.parametrize(
    "body,param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "([a-z"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ],
)
def test_unservable_requests_get_400_naming_the_field(srv, body, param):
    client = srv.openai()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="stories260K", messages=MESSAGES, max_tokens=8, extra_body=body)
    assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body


def test_auto_tool_choice_needs_a_parser():
    server = LiveServer(
        make_engine(str(STORIES_DIR), kv_cache_bytes=4 << 20, max_num_seqs=4, max_model_len=256),
        served_model_names=["stories260K"],
        model_dir=str(STORIES_DIR),
    )
    try:
        with pytest.raises(openai.BadRequestError) as err:
            server.openai().chat.completions.create(
                model="stories260K", messages=MESSAGES, tools=[WEATHER], max_tokens=8
            )
        assert err.value.body["param"] == "tool_choice" and "--tool-call-parser" in err.value.body["message"]
    finally:
        server.stop()


HERMES_REGEX = (
    r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
    r'"unit": "celsius"\}\}</tool_call>'
)


def test_auto_tool_choice_parses_hermes_calls_plain_and_streamed(srv):
    """tool_choice "auto" with --tool-call-parser hermes. stories260K never writes tool calls on its own, so a
    regex makes it write one in the Hermes format; the parser then has to find it (and, streamed, hold the
    tag back from the content)."""
    client = srv.openai()
    kwargs = dict(
        model="stories260K",
        messages=MESSAGES,
        tools=[WEATHER],
        max_tokens=240,
        temperature=0,
        extra_body={"guided_regex": HERMES_REGEX},
    )
    msg = client.chat.completions.create(**kwargs).choices[0]
    assert msg.finish_reason == "tool_calls" and msg.message.content == "Sure."
    assert msg.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(msg.message.tool_calls[0].function.arguments)["city"] in ("Paris", "Rome")
    content, calls = "", []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
            assert "<tool_call" not in content
    assert content.strip() == "Sure." and calls[0].function.name == "get_weather"


def test_tool_parsers():
    from kvserve.runtime.server.tool_parsers import HermesParser, Llama3JsonParser

    hermes = HermesParser()
    text = (
        'Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    )
    assert hermes.parse(text) == ("Let me check.", [("a", {"x": 1}), ("b", {})])
    assert hermes.parse("no calls here") == ("no calls here", [])
    assert hermes.parse("<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [])
    assert hermes.content_prefix_len("Hello <tool") == len("Hello ")  # a possible tag start is held back
    assert hermes.content_prefix_len("Hello <b>") == len("Hello <b>")
    llama = Llama3JsonParser()
    assert llama.parse('<|python_tag|>{"name": "a", "parameters": {"q": "x"}}; {"name": "b", "parameters": {}}') == (
        None,
        [("a", {"q": "x"}), ("b", {})],
    )
    assert llama.parse("The answer is 4.") == ("The answer is 4.", [])
    assert llama.content_prefix_len('{"na') == 0 and llama.content_prefix_len("Hi") == 2


# Issue 27: a schema whose numbers carry no bound (the grammar bounds their digits) and one with its own bounds.
UNBOUNDED_NUMBERS = {
    "type": "object",
    "additionalProperties": False,
    "required": ["n", "x"],
    "properties": {"n": {"type": "integer"}, "x": {"type": "number"}},
}
OWN_BOUNDS = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "tags"],
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
}


@pytest.mark.parametrize("schema", [UNBOUNDED_NUMBERS, OWN_BOUNDS], ids=["unbounded", "bounded"])
def test_sixteen_sampled_schema_requests_finish_with_stop_and_valid_json(srv, schema):
    """At temperature 1.0 on the pretrained model, 16 of 16 requests end by "stop" with output the schema
    accepts (before the digit bound, 8 of 8 unbounded ones ended by "length")."""
    client = srv.openai()
    response_format = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
    texts = []
    for seed in range(16):
        resp = client.chat.completions.create(
            model="stories260K",
            messages=[{"role": "user", "content": f"Tell me about story {seed}."}],
            temperature=1.0,
            seed=seed,
            max_tokens=96,
            response_format=response_format,
        )
        choice = resp.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)
        texts.append(choice.message.content)
    assert len(set(texts)) > 8  # sampled, not one answer sixteen times


@pytest.mark.parametrize(
    "schema, keyword",
    [
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "'not'"),
        ({"type": "string", "pattern": "(?<=a)b"}, "'pattern'"),
        ({"type": "object", "if": {"required": ["a"]}, "then": {}}, "'if'"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "'uniqueItems'"),
    ],
)
def test_unsupported_schema_keywords_are_400s_naming_the_keyword(srv, schema, keyword):
    client = srv.openai()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="stories260K",
            messages=MESSAGES,
            max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
    error = err.value.body
    assert err.value.status_code == 400 and keyword in error["message"], error
    assert error["param"].startswith("response_format.json_schema.schema"), error

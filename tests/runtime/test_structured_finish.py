"""Constrained outputs that finish (issue 27): unbounded numbers get a digit bound so sampled JSON closes,
schema bounds are kept, and keywords the grammar cannot express are refused naming the keyword."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.errors import InvalidParameter
from kvserve.runtime.structured_output import StructuredOutputSpec
from kvserve.runtime.structured_output.schema_bounds import prepare_schema

UNBOUNDED = {
    "type": "object",
    "additionalProperties": False,
    "required": ["n", "x"],
    "properties": {"n": {"type": "integer"}, "x": {"type": "number"}},
}
BOUNDED = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "tags"],
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
}


def spec(value):
    return StructuredOutputSpec.from_request("json", value, "structured_outputs")


def test_prepare_schema_bounds_only_unbounded_numbers():
    out = prepare_schema(
        {"type": "object", "properties": {"n": {"type": "integer"}, "m": {"type": "number", "maximum": 5}}}, "f", 3
    )
    assert out["properties"]["n"] == {"type": "integer", "minimum": -999, "maximum": 999}
    assert out["properties"]["m"] == {"type": "number", "maximum": 5, "minimum": -999}


@pytest.mark.parametrize(
    "schema, keyword",
    [
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "'not'"),
        ({"type": "string", "pattern": "(?<=a)b"}, "'pattern'"),
        ({"type": "object", "if": {"required": ["a"]}, "then": {}}, "'if'"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "'uniqueItems'"),
    ],
)
def test_unsupported_keywords_are_refused_by_name(stories_dir, schema, keyword):
    llm = _llm(stories_dir)
    with pytest.raises(InvalidParameter) as err:
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=spec(schema)), use_tqdm=False)
    assert keyword in str(err.value)


_LLM = {}


def _llm(stories_dir):
    if "llm" not in _LLM:
        _LLM["llm"] = LLM(stories_dir, max_model_len=512)
    return _LLM["llm"]


def test_keywords_the_grammar_expresses_are_kept():
    schema = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}, "u": {"uniqueItems": False}}}
    assert prepare_schema(schema, "f", 3)["properties"]["n"]["multipleOf"] == 3


def test_the_digit_bound_is_an_engine_setting(stories_dir):
    from kvserve.runtime.config import build_engine_config
    from kvserve.runtime.engine_args import EngineArgs

    config = build_engine_config(EngineArgs.from_kwargs(stories_dir, structured_output_max_number_digits=3))
    assert config.structured_output_max_number_digits == 3


def test_sixteen_sampled_requests_finish_with_stop_and_valid_json(stories_dir):
    # 16 different samples per schema (one seed each: the same seed on the same prompt would repeat a sample).
    llm = _llm(stories_dir)
    prompts = ["Once upon a time", "Tom said", "The little dog", "Lily was"] * 4
    for schema in (UNBOUNDED, BOUNDED):
        params = [
            SamplingParams(temperature=1.0, seed=seed, max_tokens=96, structured_outputs=spec(schema))
            for seed in range(len(prompts))
        ]
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert len({o.outputs[0].text for o in outs}) > len(prompts) // 2  # really sampled, not one answer
        for o in outs:
            c = o.outputs[0]
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), schema)

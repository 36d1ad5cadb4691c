"""Grammar-constrained decoding (runtime/structured_output): outputs always parse and validate against their
JSON schema / regex / choice, greedy and sampled, n > 1, under chunked prefill and preemption, and with
hundreds of generated schemas; bad specs are refused naming the field before any work starts."""

from __future__ import annotations

import json
import pickle
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.errors import InvalidParameter
from kvserve.runtime.structured_output import StructuredOutputSpec

PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "mood"],
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad"]},
    },
}
PROMPTS = ["Once upon a time", "Tom said", "The little dog", "Lily was"]


def spec(kind, value=None):
    return StructuredOutputSpec.from_request(kind, value, "structured_outputs")


@pytest.fixture(scope="module")
def llm(stories_dir):
    return LLM(stories_dir, max_model_len=512)


def _texts(outs):
    return [c.text for o in outs for c in o.outputs]


def test_json_schema_greedy_and_sampled_n2(llm):
    greedy = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=64, structured_outputs=spec("json", PERSON)), use_tqdm=False
    )
    sampled = llm.generate(
        PROMPTS,
        SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=64, structured_outputs=spec("json", PERSON)),
        use_tqdm=False,
    )
    for out in greedy + sampled:
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), PERSON)


def test_regex_choice_and_json_object(llm):
    outs = llm.generate(
        PROMPTS,
        SamplingParams(
            temperature=0.8,
            seed=1,
            max_tokens=32,
            structured_outputs=spec("regex", r"[A-Z][a-z]{1,8} (is|was) [0-9]{1,2}"),
        ),
        use_tqdm=False,
    )
    assert all(re.fullmatch(r"[A-Z][a-z]{1,8} (is|was) [0-9]{1,2}", t) for t in _texts(outs)), _texts(outs)
    outs = llm.generate(
        PROMPTS,
        SamplingParams(
            temperature=1.0, seed=2, max_tokens=8, structured_outputs=spec("choice", ["happy", "sad", "very angry"])
        ),
        use_tqdm=False,
    )
    assert set(_texts(outs)) <= {"happy", "sad", "very angry"}
    outs = llm.generate(
        PROMPTS[:2],
        SamplingParams(temperature=0, max_tokens=96, structured_outputs=spec("json_object")),
        use_tqdm=False,
    )
    for o in outs:
        if o.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(o.outputs[0].text), dict)
        else:  # max_tokens reached mid-object: the partial text is returned with finish_reason "length"
            assert o.outputs[0].text.startswith("{")


def test_same_output_under_chunked_prefill_and_preemption(stories_dir):
    """The matcher lives in the runner's per-request state, which survives preemption by recompute."""
    prompts = [p * 6 for p in PROMPTS]  # longer prompts: several chunks at a 32-token budget
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=spec("json", PERSON))
    ref = _texts(LLM(stories_dir, max_model_len=160).generate(prompts, params, use_tqdm=False))
    tight = LLM(stories_dir, max_model_len=160, max_num_batched_tokens=32, num_kv_blocks=12, block_size=16)
    got = _texts(tight.generate(prompts, params, use_tqdm=False))
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == ref
    for text in got:
        jsonschema.validate(json.loads(text), PERSON)


def test_bad_specs_are_refused_before_any_work(llm):
    with pytest.raises(InvalidParameter) as err:
        llm.generate(
            PROMPTS,
            [
                SamplingParams(structured_outputs=spec("regex", "a")),
                SamplingParams(structured_outputs=spec("regex", "([a-z")),
                SamplingParams(),
                SamplingParams(),
            ],
            use_tqdm=False,
        )
    assert err.value.param == "structured_outputs" and "prompts[1]" in str(err.value)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(InvalidParameter):
        spec("json", "{not json")
    with pytest.raises(InvalidParameter):
        spec("json", {"type": "object", "description": "x" * 70_000})
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(ignore_eos=True, structured_outputs=spec("json_object"))
    assert err.value.param == "ignore_eos"


def test_compiled_grammar_crosses_process_boundaries(llm):
    """TP workers and an engine-core process receive SamplingParams pickled."""
    params = llm.engine.compile_constraint(SamplingParams(structured_outputs=spec("json", PERSON)))
    import torch
    import xgrammar as xgr

    restored = pickle.loads(pickle.dumps(params))
    doc = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids  # a document it accepts
    masks = []
    for compiled in (params.compiled_constraint, restored.compiled_constraint):
        matcher, steps = xgr.GrammarMatcher(compiled.grammar), []
        for token in doc:  # the same bitmask at every step, and the same document accepted
            bitmask = xgr.allocate_token_bitmask(1, compiled.model_key[1])
            matcher.fill_next_token_bitmask(bitmask, 0)
            steps.append(bitmask.clone())
            assert matcher.accept_token(token)
        masks.append(torch.stack(steps))
    assert torch.equal(masks[0], masks[1])


# -- hundreds of generated schemas ------------------------------------------------------------------------
_leaf = st.one_of(
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(0, 100),
    ),
    st.just({"type": "boolean"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(
        lambda xs: {"enum": xs},
        st.lists(st.sampled_from(["a", "b", "cat", "dog", 1, 2, True, None]), min_size=1, max_size=4, unique=True),
    ),
)
_names = st.lists(st.sampled_from(["id", "name", "tags", "ok", "n", "color", "x"]), min_size=1, max_size=3, unique=True)


def _object(children):
    return st.builds(
        lambda names, data: {
            "type": "object",
            "additionalProperties": False,
            "required": names,
            "properties": dict(zip(names, data)),
        },
        _names,
        st.lists(children, min_size=3, max_size=3),
    )


_schema = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        _object(inner),
        st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, inner, st.integers(0, 2)),
    ),
    max_leaves=5,
)


@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(schemas=st.lists(_object(_schema), min_size=60, max_size=60))
def test_generated_schemas_always_parse_and_validate(llm, schemas):
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=400, structured_outputs=spec("json", s))
        for i, s in enumerate(schemas)
    ]
    outs = llm.generate(["Once upon a time"] * len(schemas), params, use_tqdm=False)
    for schema, out in zip(schemas, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)

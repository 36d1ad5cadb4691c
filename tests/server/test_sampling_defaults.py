"""SamplingParams is the one home of the sampling defaults: the server passes on only the fields a client set,
and the request models' defaults are read from SamplingParams (no second copy to drift)."""

from __future__ import annotations

import dataclasses

import pytest

from kvserve.runtime.sampling_params import SamplingParams
from kvserve.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.runtime.server.serving import SAMPLING_FIELDS, client_sampling_fields

PARAM_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams) if f.init}
SET_VALUES = dict(
    n=2,
    temperature=0.5,
    top_p=0.9,
    top_k=7,
    min_p=0.1,
    seed=3,
    min_tokens=2,
    stop=["x"],
    stop_token_ids=[5],
    ignore_eos=True,
    presence_penalty=0.5,
    frequency_penalty=-0.5,
    repetition_penalty=1.2,
    skip_special_tokens=False,
    include_stop_str_in_output=True,
)


def _request(kind, **fields):
    if kind == "completion":
        return CompletionRequest(prompt="hi", **fields)
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_unset_fields_take_sampling_params_defaults(kind):
    assert client_sampling_fields(_request(kind)) == {}
    # an explicit null is "not set" too
    assert client_sampling_fields(_request(kind, temperature=None, top_p=None, top_k=None)) == {}


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_each_set_field_is_passed_as_given(kind):
    assert set(SET_VALUES) == set(SAMPLING_FIELDS)
    for name, value in SET_VALUES.items():
        assert value != PARAM_DEFAULTS[name], name  # else the check below could not fail
        assert client_sampling_fields(_request(kind, **{name: value})) == {name: value}, name
    params = SamplingParams(**client_sampling_fields(_request(kind, **SET_VALUES)))
    assert all(getattr(params, name) == value for name, value in SET_VALUES.items())


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_request_model_defaults_are_sampling_params_defaults(model):
    for name in SAMPLING_FIELDS:
        default = model.model_fields[name].default
        assert default is None or default == PARAM_DEFAULTS[name], name

"""The runner's argmax shortcut applies only where sample() would do nothing but argmax, and then agrees."""

from __future__ import annotations

import pytest
import torch

from kvserve.runtime.sampling import RequestSamplingState, is_plain_greedy, sample
from kvserve.runtime.sampling_params import SamplingParams


def state(**params) -> RequestSamplingState:
    return RequestSamplingState(SamplingParams(**params), [5, 6], (2,), torch.device("cpu"), None)


def test_plain_greedy_agrees_with_sample():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    states = [state(temperature=0) for _ in range(6)]
    assert all(is_plain_greedy(s) for s in states)
    tokens, logprobs, failed = sample(logits, states)
    assert tokens == logits.argmax(dim=-1).tolist() and logprobs == [None] * 6 and failed == {}


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.7),
        dict(temperature=0, repetition_penalty=1.2),
        dict(temperature=0, frequency_penalty=0.5),
        dict(temperature=0, presence_penalty=1),
        dict(temperature=0, min_tokens=3),
        dict(temperature=0, logprobs=0),
    ],
)
def test_anything_that_changes_the_outcome_is_not_plain(params):
    assert not is_plain_greedy(state(**params))


def test_min_tokens_without_stop_ids_is_plain():
    assert is_plain_greedy(state(temperature=0, min_tokens=3, ignore_eos=True))

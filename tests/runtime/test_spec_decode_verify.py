"""The verifier: greedy acceptance equals one-at-a-time argmax, and rejection sampling leaves each emitted
token distributed exactly as the target's (temperature/top-k) distribution, whatever the drafts."""

from __future__ import annotations

import pytest
import torch

from kvserve.runtime.sampling import RequestSamplingState, sampling_probs
from kvserve.runtime.sampling_params import SamplingParams
from kvserve.runtime.spec_decode.verify import accept_greedy, accept_sampled, verify

VOCAB = 6


def state(seed=0, **params) -> RequestSamplingState:
    return RequestSamplingState(SamplingParams(seed=seed, **params), [1], (), torch.device("cpu"), None)


def test_greedy_accepts_the_matching_prefix_then_the_target():
    assert accept_greedy([4, 5, 6], [4, 5, 1, 9]) == [4, 5, 1]
    assert accept_greedy([4, 5], [4, 5, 3]) == [4, 5, 3]  # all accepted: the bonus token
    assert accept_greedy([4], [0, 3]) == [0]
    logits = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(1))
    states = {"g": state(temperature=0), "h": state(temperature=0)}
    target = logits.argmax(-1).tolist()
    # g drafted rows 0..2 (2 drafts: the target's first one, then a wrong one), h rows 3..6 (3 drafts).
    drafted = [("g", [target[0], (target[1] + 1) % VOCAB], 0), ("h", target[3:6], 3)]
    out, failed = verify(logits, drafted, states)
    assert out == {"g": target[0:2], "h": target[3:7]} and failed == {}
    assert states["h"].output_token_ids == target[3:7]


def empirical(samples: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(samples), minlength=VOCAB).double() / len(samples)


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=4)])
def test_rejection_sampling_keeps_the_target_distribution(params):
    rows = torch.tensor(
        [[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.1, 1.5, -0.5, 0.7, 0.0, 1.0], [1.0, 0.0, 0.0, 2.0, 0.0, 0.5]]
    )
    p = [sampling_probs(r, SamplingParams(**params)) for r in rows]
    p = [x / x.sum() for x in p]
    st = state(seed=123, **params)
    n = 4000
    for drafts in ([0, 1], [4, 3]):  # a likely first draft, and an unlikely one (rejected mostly)
        firsts, seconds = [], []
        for _ in range(n):
            tokens = accept_sampled(rows, drafts, st)
            firsts.append(tokens[0])
            if tokens[0] == drafts[0]:
                seconds.append(tokens[1])
        tv_first = 0.5 * (empirical(firsts) - p[0].double()).abs().sum().item()
        assert tv_first < 0.03, (drafts, tv_first)
        if len(seconds) > 1000:  # given the first draft was accepted, the second token follows p at row 1
            tv_second = 0.5 * (empirical(seconds) - p[1].double()).abs().sum().item()
            assert tv_second < 0.05, (drafts, tv_second)

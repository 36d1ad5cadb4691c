"""Rejection sampling with a draft model's q (not one-hot): drafts drawn from q, accepted with min(1, p/q),
rejections resampled from max(p - q, 0): each emitted token is distributed as the target's p, and a draft
is accepted with probability sum(min(p, q)) -- more than the one-hot rule's sum(q p) for the same drafts."""

from __future__ import annotations

import pytest
import torch

from kvserve.runtime.sampling import RequestSamplingState, sampling_probs
from kvserve.runtime.sampling_params import SamplingParams
from kvserve.runtime.spec_decode.verify import accept_sampled, verify

VOCAB = 6
ROWS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.1, 1.5, -0.5, 0.7, 0.0, 1.0], [1.0, 0.0, 0.0, 2.0, 0.0, 0.5]])
# The draft's distributions at the two drafted positions: overlapping p, but far from it.
Q = torch.tensor([[0.05, 0.1, 0.5, 0.05, 0.25, 0.05], [0.4, 0.1, 0.1, 0.1, 0.2, 0.1]])


def state(seed=0, **params) -> RequestSamplingState:
    return RequestSamplingState(SamplingParams(seed=seed, **params), [1], (), torch.device("cpu"), None)


def empirical(samples: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(samples), minlength=VOCAB).double() / len(samples)


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=4)])
def test_a_non_one_hot_q_keeps_the_target_distribution(params):
    p = [sampling_probs(r, SamplingParams(**params)) for r in ROWS]
    p = [(x / x.sum()).double() for x in p]
    st = state(seed=11, **params)
    draw = torch.Generator().manual_seed(5)  # the draft's own randomness, independent of the verifier's
    n = 6000
    firsts, seconds, accepted_first = [], [], 0
    for _ in range(n):
        drafts = [int(torch.multinomial(Q[i], 1, generator=draw)) for i in range(2)]
        tokens = accept_sampled(ROWS, drafts, st, Q)
        assert 1 <= len(tokens) <= 3
        firsts.append(tokens[0])
        if tokens[0] == drafts[0] and len(tokens) > 1:
            accepted_first += 1
            seconds.append(tokens[1])
    tv_first = 0.5 * (empirical(firsts) - p[0]).abs().sum().item()
    assert tv_first < 0.03, tv_first
    tv_second = 0.5 * (empirical(seconds) - p[1]).abs().sum().item()
    assert tv_second < 0.05, tv_second
    # min(1, p/q) acceptance: P(accept) = sum(min(p, q)), not the one-hot rule's sum(q p).
    expected = torch.minimum(p[0], Q[0].double()).sum().item()
    one_hot = (p[0] * Q[0].double()).sum().item()
    assert abs(accepted_first / n - expected) < 0.03 and expected - one_hot > 0.1, (accepted_first / n, expected)


def test_verify_takes_q_per_request_and_keeps_one_hot_for_the_rest():
    """verify(draft_probs=...): the request with q uses it; one without is verified with the one-hot rule;
    q == p (the target as its own draft) accepts every draft."""
    params = dict(temperature=1.0)
    p = [sampling_probs(r, SamplingParams(**params)) for r in ROWS]
    q_equal = torch.stack([x / x.sum() for x in p[:2]]).numpy()  # numpy rows, as ScheduledRequest carries them
    accepted = {"q": 0, "one_hot": 0}
    for seed in range(300):
        states = {"q": state(seed=seed, **params), "one_hot": state(seed=seed, **params)}
        drafts = [3, 1]  # unlikely under p at row 0: the one-hot rule mostly rejects it
        logits = torch.cat([ROWS, ROWS])
        out, failed = verify(logits, [("q", drafts, 0), ("one_hot", drafts, 3)], states, draft_probs={"q": q_equal})
        assert failed == {}
        for rid in out:
            accepted[rid] += next((i for i, d in enumerate(drafts) if out[rid][i] != d), len(drafts))
            assert states[rid].output_token_ids == out[rid]
    assert accepted["q"] == 2 * 300  # p/q == 1 everywhere: always accepted, both drafts
    assert accepted["one_hot"] < 0.2 * 600

"""Beam search (LLM.beam_search) matches HF transformers' generate(num_beams=k, do_sample=False): the same
top beams, in order, with the same scores, for early_stopping True / False / "never" and several length
penalties, on a random-weight fp32 model whose EOS is a token the beams really produce (so hypotheses end
early, by EOS, as well as by length). Plus the pure algorithm on hand-made logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.runtime.engine.beam_search import BeamSearch, BeamSearchParams
from kvserve.runtime.errors import InvalidParameter

PROMPTS = [[5, 17, 33, 2, 8, 11, 40], [60, 61, 9, 9, 70], [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]]


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory):
    """(model dir, HF model, eos id) whose EOS is a token the first prompt's best beam contains."""
    from kvserve_testing import TEST_MODEL_CONFIGS

    from kvserve.runtime.models.synthetic import make_random_model_dir

    arch, kwargs = TEST_MODEL_CONFIGS["llama_gqa"]
    probe = make_random_model_dir(str(tmp_path_factory.mktemp("beam-probe")), arch, seed=1234, **kwargs)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        best = probe.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            num_beams=3,
            do_sample=False,
            max_new_tokens=8,
            eos_token_id=-1,
            pad_token_id=0,
        )
    eos = best[0, len(PROMPTS[0]) + 6].item()
    out = str(tmp_path_factory.mktemp("beam-eos"))
    return out, make_random_model_dir(out, arch, seed=1234, eos_token_id=eos, **kwargs), eos


@pytest.fixture(scope="module")
def eos_llm(eos_model):
    from kvserve.runtime import LLM

    return LLM(eos_model[0], max_model_len=128, block_size=8, num_kv_blocks=256, seed=0)


def hf_beams(hf_model, prompt, k, max_new, early_stopping, length_penalty, eos):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        gen = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            num_beams=k,
            num_return_sequences=k,
            do_sample=False,
            max_new_tokens=max_new,
            early_stopping=early_stopping,
            length_penalty=length_penalty,
            pad_token_id=eos,
            eos_token_id=eos,
            return_dict_in_generate=True,
            output_scores=True,
        )
    beams = []
    for seq, score in zip(gen.sequences, gen.sequences_scores):
        out = seq[len(prompt) :].tolist()
        if eos in out:
            out = out[: out.index(eos) + 1]
        beams.append((out, float(score)))
    return beams


@pytest.mark.parametrize(
    "early_stopping, length_penalty",
    [(True, 1.0), (False, 1.0), ("never", 1.0), (False, 0.0), (True, -0.5), ("never", 2.0)],
)
def test_top_beams_match_hf_generate(eos_model, eos_llm, early_stopping, length_penalty):
    _, hf_model, eos = eos_model
    llm = eos_llm
    k, max_new = 3, 10
    params = BeamSearchParams(
        beam_width=k, max_tokens=max_new, early_stopping=early_stopping, length_penalty=length_penalty
    )
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    ended_by_eos = 0
    for prompt, out in zip(PROMPTS, outs):
        expected = hf_beams(hf_model, prompt, k, max_new, early_stopping, length_penalty, eos)
        got = [(s.output_token_ids, s.score) for s in out.sequences]
        assert [t for t, _ in got] == [t for t, _ in expected], prompt
        for (_, ours), (_, theirs) in zip(got, expected):
            assert math.isclose(ours, theirs, rel_tol=1e-4, abs_tol=1e-4)
        for s in out.sequences:
            assert s.tokens == prompt + s.output_token_ids
            assert s.finish_reason == ("stop" if s.output_token_ids[-1] == eos else "length")
            ended_by_eos += s.finish_reason == "stop"
    if length_penalty <= 1.0:  # (a large penalty favours the long beams: they all end by length)
        assert ended_by_eos > 0  # the EOS path was exercised, not only max length


def test_algorithm_keeps_k_finished_and_stops_early_on_hand_made_logprobs():
    lp = math.log
    search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=5, early_stopping=True), frozenset({0}))
    assert search.pending() == [[]]
    # Step 1 (one beam): EOS is the best candidate -> a finished hypothesis of length 1; 7 and 8 go on.
    search.advance([[(0, lp(0.5)), (7, lp(0.3)), (8, lp(0.15)), (9, lp(0.05))]])
    assert [h.token_ids for h in search.finished] == [[0]]
    assert search.pending() == [[7], [8]]
    # Step 2: 7's EOS ranks among the top 2 -> second finished hypothesis; early_stopping=True: done.
    search.advance([[(0, lp(0.9)), (3, lp(0.1))], [(4, lp(0.6)), (0, lp(0.4))]])
    # Best first by cum_logprob / length: (log .3 + log .9) / 2 = -0.654 beats log .5 = -0.693.
    assert search.done and [h.token_ids for h in search.results()] == [[7, 0], [0]]
    assert math.isclose(search.results()[0].score, (lp(0.3) + lp(0.9)) / 2)


def test_parameters_are_checked_naming_the_field():
    with pytest.raises(InvalidParameter) as err:
        BeamSearchParams(beam_width=11, max_tokens=4)
    assert err.value.param == "n"
    with pytest.raises(InvalidParameter) as err:
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")
    assert err.value.param == "early_stopping"
    with pytest.raises(InvalidParameter):
        BeamSearch(BeamSearchParams(beam_width=10, max_tokens=4), frozenset({1, 2}))  # 30 candidates > 20


@pytest.mark.parametrize("family", ["qwen2_qkv_bias", "llama_tied_mqa", "mixtral_moe", "qwen3_head_dim"])
def test_top_beams_match_hf_generate_on_the_other_parity_families(model_factory, family):
    """The same comparison on the other parity families (fp32), with each model's own EOS."""
    from kvserve.runtime import LLM

    model_dir, hf_model = model_factory(family)
    eos = hf_model.config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    k, max_new = 3, 8
    params = BeamSearchParams(beam_width=k, max_tokens=max_new, early_stopping=True, length_penalty=1.0)
    with LLM(model_dir, max_model_len=128, block_size=8, num_kv_blocks=256, seed=0) as llm:
        outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, outs):
        expected = hf_beams(hf_model, prompt, k, max_new, True, 1.0, eos)
        got = [(s.output_token_ids, s.score) for s in out.sequences]
        assert [t for t, _ in got] == [t for t, _ in expected], (family, prompt)
        for (_, ours), (_, theirs) in zip(got, expected):
            assert math.isclose(ours, theirs, rel_tol=1e-4, abs_tol=1e-4), family

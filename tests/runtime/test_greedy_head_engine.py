"""All-greedy steps on CPU take their tokens straight from the LM head (runtime/models/greedy_head.py): an fp32
engine screens its head in bf16, a bf16 engine argmaxes the head's bf16 output; both answer as with full logits,
and steps with a request that needs the logits (logprobs here) still compute them."""

from __future__ import annotations

import pytest
import torch
from kvserve_testing import hf_greedy, random_prompts

from kvserve.kernels import cpu_ops
from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.models import greedy_head

if not cpu_ops.load():
    pytest.skip(f"compiled CPU ops unavailable: {cpu_ops.unavailable_reason()}", allow_module_level=True)
if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
    pytest.skip("no oneDNN bf16 GEMM on this CPU", allow_module_level=True)


def engine(model_dir: str, screen: bool, monkeypatch, dtype: str = "float32") -> tuple[LLM, list[int]]:
    """The engine (with the greedy head, or without: full logits every step), and a list that grows by the row
    count of every greedy-head call."""
    monkeypatch.setattr(greedy_head, "for_model", greedy_head.for_model if screen else lambda *a: None)
    # On a CPU without native bf16 dot products the runner would not build the screen; the test wants it anyway.
    monkeypatch.setattr(greedy_head, "bf16_dot_products_native", lambda: True)
    llm = LLM(model_dir, dtype=dtype, attention_backend="cpu", kv_cache_bytes=64 << 20, max_num_seqs=8)
    runner = llm.engine.executor.runner
    calls: list[int] = []
    if screen:
        kind = greedy_head.ScreenedGreedyHead if dtype == "float32" else greedy_head.HeadArgmax
        assert isinstance(runner.greedy_head, kind)
        tokens = runner.greedy_head.tokens

        def counted(hidden):
            calls.append(hidden.shape[0])
            return tokens(hidden)

        monkeypatch.setattr(runner.greedy_head, "tokens", counted)
    else:
        assert runner.greedy_head is None
    return llm, calls


@pytest.mark.parametrize("name", ["llama_tied_mqa", "llama_gqa"])  # a tied head (the embedding) and an untied one
def test_greedy_tokens_equal_full_logits_and_transformers(name, model_factory, monkeypatch):
    model_dir, hf = model_factory(name)
    prompts = random_prompts(6, 512, 3, 40, seed=3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    answers = {}
    for screen in (True, False):
        llm, calls = engine(model_dir, screen, monkeypatch)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        answers[screen] = [list(o.outputs[0].token_ids) for o in outs]
        if screen:  # every step: the prefill's last rows, then the decodes
            assert len(calls) >= 12 and sum(calls) == 6 * 12
    assert answers[True] == answers[False]
    assert answers[True] == hf_greedy(hf, prompts, 12)


def test_a_bf16_engine_argmaxes_the_bf16_head_output(model_factory, monkeypatch):
    model_dir, _ = model_factory("llama_gqa", "bfloat16")
    prompts = random_prompts(6, 512, 3, 40, seed=5)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    answers = {}
    for screen in (True, False):
        llm, calls = engine(model_dir, screen, monkeypatch, dtype="bfloat16")
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        answers[screen] = [list(o.outputs[0].token_ids) for o in outs]
        assert (sum(calls) == 6 * 10) if screen else calls == []
    assert answers[True] == answers[False]


def test_the_switch_turns_the_fp32_screen_off(model_factory, monkeypatch):
    monkeypatch.setenv(greedy_head.ENV_SWITCH, "0")
    llm = LLM(model_factory("llama_gqa")[0], dtype="float32", attention_backend="cpu", kv_cache_bytes=64 << 20)
    assert llm.engine.executor.runner.greedy_head is None


def test_a_step_with_logprobs_computes_full_logits(model_factory, monkeypatch):
    model_dir, _ = model_factory("llama_tied_mqa")
    prompts = random_prompts(2, 512, 5, 20, seed=4)
    llm, calls = engine(model_dir, True, monkeypatch)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2),
        ],
        use_tqdm=False,
    )
    assert calls == []  # every step had the logprobs request in it
    assert all(len(step) >= 1 for step in outs[1].outputs[0].logprobs)
    greedy_alone = llm.generate(
        [{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )
    assert calls  # alone, the greedy request's steps are screened
    assert list(greedy_alone[0].outputs[0].token_ids) == list(outs[0].outputs[0].token_ids)

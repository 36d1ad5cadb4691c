"""One request never hurts another, in the engine itself (defence in depth behind edge validation):
a request-specific failure inside a step fails that request alone (its blocks freed, the others' outputs
unchanged); a step failure no request explains fails that step's requests retryably; too many in a row,
or a dead worker, make the engine dead. And the offline API refuses a bad prompt among 100 up front."""

from __future__ import annotations

import pytest

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.errors import STEP_FAILED, EngineDeadError, InvalidParameter
from kvserve.runtime.sampling_params import INT64_MAX

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]


@pytest.fixture(scope="module")
def llm(model_factory):
    model_dir, _ = model_factory("llama_gqa")
    return LLM(
        model_dir, max_model_len=64, num_kv_blocks=64, block_size=16, max_num_seqs=4, max_consecutive_step_failures=2
    )


@pytest.fixture(scope="module")
def solo(llm):
    """Each prompt's greedy output when run alone: what it must still be next to a failing request."""
    return [llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


def _run(engine, requests: dict[str, tuple[list[int], SamplingParams]], tamper=None) -> dict:
    """Add the requests, let `tamper(engine)` break something after validation, step to the end."""
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
    if tamper is not None:
        tamper(engine)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def _assert_all_blocks_free(engine):
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks and not engine.scheduler.requests


def _innocents(solo, fresh_params=lambda: SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)):
    return {f"ok{i}": (PROMPTS[i], fresh_params()) for i in (0, 2, 3)}


@pytest.mark.parametrize("breakage", ["stop_token_id_out_of_vocab", "seed_overflow", "detokenizer"])
def test_request_specific_failure_fails_that_request_alone(llm, solo, breakage):
    engine = llm.engine
    bad = SamplingParams(temperature=0.8, max_tokens=12, seed=1)
    requests = {"bad": (PROMPTS[1], bad), **_innocents(solo)}

    def tamper(engine):
        # What validation at the edge would refuse; simulates a check it missed (the params are shared).
        if breakage == "stop_token_id_out_of_vocab":  # issue 9's reproduction 2: IndexError in min-tokens masking
            bad.stop_token_ids, bad.min_tokens = [10**9], 2
        elif breakage == "seed_overflow":  # reproduction 1: torch.Generator.manual_seed overflows
            bad.seed = 2**70
        else:
            real = engine.output_processor._detokenize
            bad_sample = engine._states["bad"].samples[0]

            def broken(sample, skip, final):
                if sample is bad_sample:
                    raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
                return real(sample, skip, final)

            engine.output_processor._detokenize = broken

    try:
        final = _run(engine, requests, tamper)
    finally:
        engine.output_processor.__dict__.pop("_detokenize", None)
    error = final["bad"].error
    assert error is not None and not error.retryable and final["bad"].outputs[0].finish_reason == "error"
    assert "Error(" not in error.message and "Traceback" not in error.message
    for i, rid in zip((0, 2, 3), ("ok0", "ok2", "ok3")):
        assert final[rid].error is None and final[rid].outputs[0].token_ids == solo[i], rid
    _assert_all_blocks_free(engine)


def test_failed_forward_fails_its_step_retryably_and_poisons_no_cache(llm, model_factory):
    engine = llm.engine
    # Longer than a block, and never seen by this engine: step 1 allocates (and caches ahead of the forward)
    # full blocks for them, and the failed forward never writes their KV.
    long_prompts = [[40 + i] + list(range(100, 120)) for i in range(3)]
    real = engine.executor.execute
    calls = {"n": 0}

    def execute(sched):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected forward failure")
        return real(sched)

    engine.executor.execute = execute
    try:
        final = _run(
            engine,
            {
                f"r{i}": (p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
                for i, p in enumerate(long_prompts)
            },
        )
    finally:
        del engine.executor.execute
    assert all(out.error == STEP_FAILED for out in final.values()), final  # all three were in step 1
    assert engine.num_step_failures >= 1
    _assert_all_blocks_free(engine)
    again = llm.generate([{"prompt_token_ids": p} for p in long_prompts], GREEDY, use_tqdm=False)
    assert engine.num_consecutive_step_failures == 0
    model_dir, _ = model_factory("llama_gqa")
    reference = LLM(model_dir, max_model_len=64, num_kv_blocks=64, block_size=16, max_num_seqs=4)
    expected = reference.generate([{"prompt_token_ids": p} for p in long_prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in expected]


def test_consecutive_step_failures_kill_the_engine(model_factory):
    model_dir, _ = model_factory("llama_gqa")
    llm = LLM(model_dir, max_model_len=64, num_kv_blocks=32, max_consecutive_step_failures=2)
    engine = llm.engine

    def execute(sched):
        raise RuntimeError("device lost")

    engine.executor.execute = execute
    engine.add_request("a", {"prompt_token_ids": [5, 6]}, GREEDY)
    first = engine.step()
    assert [o.error for o in first] == [STEP_FAILED]
    engine.add_request("b", {"prompt_token_ids": [5, 6]}, GREEDY)
    with pytest.raises(EngineDeadError, match="2 consecutive failed steps"):
        engine.step()
    for call in (engine.step, engine.check_health, lambda: engine.add_request("c", [5], GREEDY)):
        with pytest.raises(EngineDeadError):
            call()
    with pytest.raises(EngineDeadError):
        llm.generate([[5, 6]], GREEDY, use_tqdm=False)


def test_bad_prompt_among_100_fails_before_any_work_naming_its_index(llm):
    engine = llm.engine
    prompts = [{"prompt_token_ids": [5 + i % 20, 6]} for i in range(100)]
    cases = [
        (57, {"prompt_token_ids": [5, 10**6]}, None, "prompt"),  # token id outside the vocabulary
        (3, "a lone \ud800 surrogate", None, "prompt"),
        (99, {"prompt_token_ids": list(range(5, 70))}, None, "prompt"),  # longer than max_model_len=64
    ]
    for index, bad, _, field in cases:
        batch = list(prompts)
        batch[index] = bad
        before = engine.generation_tokens
        with pytest.raises(InvalidParameter, match=rf"^prompts\[{index}\]: ") as info:
            llm.generate(batch, GREEDY, use_tqdm=False)
        assert info.value.param == field
        assert not engine.has_unfinished_requests() and engine.generation_tokens == before
    # per-prompt params: the 42nd asks for an out-of-vocabulary stop token, another for n > max_num_seqs
    for index, params, field in (
        (42, SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
        (7, SamplingParams(n=5), "n"),
    ):
        params_list = [GREEDY] * 100
        params_list[index] = params
        with pytest.raises(InvalidParameter, match=rf"^prompts\[{index}\]: ") as info:
            llm.generate(prompts, params_list, use_tqdm=False)
        assert info.value.param == field
        assert not engine.has_unfinished_requests()
    assert len(llm.generate(prompts[:3], GREEDY, use_tqdm=False)) == 3  # and the engine still works


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(seed=2**63), "seed"),
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(seed=INT64_MAX, n=2), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(n=True), "n"),
        (dict(n=65), "n"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=float("inf")), "top_p"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(stop=["x" * 1025]), "stop"),
        (dict(stop=["ok", "\udc80"]), "stop"),
        (dict(stop=7), "stop"),
        (dict(stop_token_ids=list(range(1025))), "stop_token_ids"),
        (dict(stop_token_ids=5), "stop_token_ids"),
        (dict(ignore_eos="yes"), "ignore_eos"),
    ],
)
def test_sampling_params_bounds(kwargs, field):
    with pytest.raises(InvalidParameter) as info:
        SamplingParams(**kwargs)
    assert info.value.param == field
    SamplingParams(seed=INT64_MAX)  # the largest seed is fine with n=1
    SamplingParams(seed=INT64_MAX - 1, n=2)


def test_tiny_top_p_keeps_the_most_likely_token():
    """Found by the server fuzz test: top_p=5e-324 is 0 in float32, so every token was dropped and
    torch.multinomial raised. The most likely token always stays."""
    import torch

    from kvserve.runtime.sampling import RequestSamplingState, sample

    state = RequestSamplingState(SamplingParams(top_p=5e-324, seed=3), [1], (2,), torch.device("cpu"), None)
    tokens, _, failed = sample(torch.tensor([[0.0, 1.0, 5.0, 2.0]]), [state])
    assert tokens == [2] and not failed


@pytest.mark.parametrize(
    "ids,kwargs,field",
    [
        ([], {}, "prompt"),
        ([5] * 65, {}, "prompt"),
        ([5, 512], {}, "prompt"),
        ([5, -1], {}, "prompt"),
        ([5, True], {}, "prompt"),
        ([5], dict(stop_token_ids=[512]), "stop_token_ids"),
        ([5], dict(n=5), "n"),
        ([5] * 60, dict(max_tokens=5), "max_tokens"),
        ([5] * 60, dict(max_tokens=None, min_tokens=5), "min_tokens"),
    ],
)
def test_verify_request_names_the_field(ids, kwargs, field):
    from kvserve.runtime.sampling_params import RequestLimits, verify_request

    limits = RequestLimits(vocab_size=512, max_model_len=64, max_num_seqs=4, block_size=16, num_usable_blocks=8)
    with pytest.raises(InvalidParameter) as info:
        verify_request(ids, SamplingParams(**{"max_tokens": 4, **kwargs}), limits)
    assert info.value.param == field
    verify_request([5] * 60, SamplingParams(max_tokens=4, n=4), limits)  # the largest that fits
    small_pool = RequestLimits(vocab_size=512, max_model_len=64, max_num_seqs=4, block_size=16, num_usable_blocks=3)
    with pytest.raises(InvalidParameter, match="KV pool has 3") as info:  # one sequence can never fit
        verify_request([5] * 60, SamplingParams(max_tokens=4), small_pool)
    assert info.value.param == "max_tokens"

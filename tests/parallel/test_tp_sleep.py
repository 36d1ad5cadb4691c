"""Sleep mode with tensor_parallel_size=2 (the multiproc executor): every rank frees its KV cache (level 1) or
its weights too (level 2, re-read on wake), and greedy output after each wake equals the output before."""

from __future__ import annotations

import pytest
from kvserve_testing import random_prompts

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.engine.sleep_control import SleepModeError


@pytest.mark.timeout(300)
def test_tp2_sleep_wake_on_every_rank_keeps_greedy_output(tp_model_factory):
    model_dir, hf_model = tp_model_factory("llama_gqa")
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, hf_model.config.vocab_size, 4, 40, seed=5)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(model=model_dir, tensor_parallel_size=2, enable_sleep_mode=True, max_model_len=256, seed=0) as llm:

        def greedy():
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

        before = greedy()
        executor = llm.engine.core.executor
        assert all(r.kv_tensor_bytes > 0 for r in executor.describe_ranks())
        llm.sleep(1)
        assert llm.is_sleeping()
        assert [r.kv_tensor_bytes for r in executor.describe_ranks()] == [0, 0]  # every rank freed its KV
        llm.wake_up()
        assert not llm.is_sleeping() and all(r.kv_tensor_bytes > 0 for r in executor.describe_ranks())
        assert greedy() == before
        llm.sleep(2)
        llm.wake_up()
        assert greedy() == before


def test_sleep_needs_the_flag(tp_model_factory):
    model_dir, _ = tp_model_factory("llama_gqa")
    with LLM(model=model_dir, max_model_len=256, seed=0) as llm:
        with pytest.raises(SleepModeError, match="--enable-sleep-mode"):
            llm.sleep(1)
        assert not llm.is_sleeping()

"""tensor_parallel_size=2 for dense Qwen3 (q/k norms, head_dim 32 != hidden/heads), Gemma 2 (KV heads split)
and Gemma 3 (one KV head, replicated on both ranks) on CPU/gloo: greedy tokens equal transformers', with a
prefix-cache hit (through the sliding-window KV groups for Gemma). Qwen3-MoE: test_tp_moe.py."""

from __future__ import annotations

import pytest
from kvserve_testing import hf_greedy, random_prompts

from kvserve.runtime import LLM, SamplingParams


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["qwen3_head_dim", "gemma2_sliding", "gemma3_sliding"])
def test_tp2_matches_hf(tp_model_factory, name):
    model_dir, hf_model = tp_model_factory(name)
    prompts = random_prompts(5, hf_model.config.vocab_size, 4, 70, seed=7)
    prompts.append(prompts[0][:40] + [7, 8, 9])  # prefix-cache hit across the ranks
    expected = hf_greedy(hf_model, prompts, 16)
    with LLM(model_dir, tensor_parallel_size=2, max_model_len=128, max_num_batched_tokens=48, seed=0) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
            use_tqdm=False,
        )
        stats = llm.engine.get_stats()
        assert (llm.engine.kv_cache_manager.num_groups > 1) == name.startswith("gemma")
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert stats.prefix_cache_hits > 0

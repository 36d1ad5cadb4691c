"""Greedy output is token-exact with transformers `generate`, on five architectures/configs."""

from __future__ import annotations

import zlib

import pytest
from kvserve_testing import TEST_MODEL_CONFIGS, hf_greedy, random_prompts

from kvserve.runtime import LLM, SamplingParams

MAX_NEW = 24


@pytest.mark.parametrize("name", sorted(TEST_MODEL_CONFIGS))
def test_greedy_matches_hf(model_factory, name):
    model_dir, hf_model = model_factory(name)
    # Lengths 1..70 with block_size 16 cross several block boundaries, including exact multiples.
    prompts = random_prompts(20, 512, 1, 70, seed=zlib.crc32(name.encode())) + [[5] * 16, [7] * 32]
    expected = hf_greedy(hf_model, prompts, MAX_NEW)
    llm = LLM(model_dir, block_size=16, num_kv_blocks=128, max_model_len=256, seed=0)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
        use_tqdm=False,
    )
    got = [o.outputs[0].token_ids for o in outs]
    mismatches = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert not mismatches, (
        f"{name}: prompts {mismatches} differ, e.g. {got[mismatches[0]]} vs {expected[mismatches[0]]}"
    )

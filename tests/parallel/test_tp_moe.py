"""tensor_parallel_size=2 for the MoE families on CPU/gloo: greedy tokens equal transformers', and each rank
holds exactly its share of the weights -- every expert, with half of each expert's intermediate dim."""

from __future__ import annotations

import pytest
from kvserve_testing import hf_greedy, random_prompts

from kvserve.runtime import LLM, SamplingParams


def expected_rank_param_elements(cfg, t: int) -> int:
    """Parameters one rank allocates (written out from the layout, independently of the model code)."""
    h, vocab, layers = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q_local, kv_local = cfg.num_attention_heads // t, cfg.num_key_value_heads // t
    qk_norm = cfg.model_type.startswith("qwen3")
    attention = h * (q_local + 2 * kv_local) * hd + q_local * hd * h + (2 * hd if qk_norm else 0)
    if cfg.model_type == "mixtral":
        experts, expert_width, dense_layers = cfg.num_local_experts, cfg.intermediate_size, set()
    else:
        experts, expert_width, dense_layers = cfg.num_experts, cfg.moe_intermediate_size, set(cfg.mlp_only_layers)
    total = 0
    for i in range(layers):
        if i in dense_layers:
            mlp = 3 * h * cfg.intermediate_size // t  # gate/up column-, down row-parallel
        else:
            mlp = experts * 3 * h * expert_width // t + experts * h  # split experts + replicated router
        total += attention + mlp + 2 * h  # + two replicated RMSNorms
    heads = 1 if cfg.tie_word_embeddings else 2
    return total + heads * -(-vocab // t) * h + h


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["mixtral_moe", "qwen3_moe"])
def test_tp2_moe_matches_hf_with_experts_split_per_rank(tp_model_factory, name):
    model_dir, hf_model = tp_model_factory(name)
    cfg = hf_model.config
    prompts = random_prompts(8, cfg.vocab_size, 4, 70, seed=5)
    prompts.append(prompts[0][:40] + [7, 8, 9])  # prefix-cache hit across the ranks
    expected = hf_greedy(hf_model, prompts, 16)
    with LLM(model_dir, tensor_parallel_size=2, max_model_len=128, max_num_batched_tokens=48, seed=0) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
            use_tqdm=False,
        )
        info = llm.engine.executor.describe_ranks()
        stats = llm.engine.get_stats()
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert stats.prefix_cache_hits > 0
    whole = expected_rank_param_elements(cfg, 1)
    assert whole == sum(p.numel() for p in hf_model.parameters())  # the formula is the model's at t=1
    for i in info:  # measured on each worker's tensors (fp32: 4 bytes a parameter)
        assert i.param_bytes == 4 * expected_rank_param_elements(cfg, 2)
        assert 0.5 < i.param_bytes / (4 * whole) < 0.56  # half, plus the replicated routers and norms

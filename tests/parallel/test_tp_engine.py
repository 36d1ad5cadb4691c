"""tensor_parallel_size=2 on CPU/gloo: token-exact with t=1, and each rank holds its share of the weights and
KV cache (measured on the workers' tensors)."""

from __future__ import annotations

import pytest
from kvserve_testing import random_prompts

from kvserve.runtime import LLM, SamplingParams

MAX_MODEL_LEN = 256
# Small token budget: long prompts are chunked, so the ranks also agree across chunked prefill.
COMMON = dict(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64, max_num_seqs=8, seed=0)


def _workload(vocab: int):
    prompts = random_prompts(5, vocab, 4, 90, seed=3)
    prompts.append(prompts[0][:40] + [7, 8, 9])  # shares full blocks with prompts[0]: prefix-cache hits
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True) for _ in prompts]
    params[1] = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True)
    params[2] = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    return [{"prompt_token_ids": p} for p in prompts], params


def _run(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def _expected_rank_param_bytes(cfg, t: int, kv_heads_local: int) -> int:
    """Exact parameter bytes of one rank: every matrix split t ways except the replicated norms (and the
    K/V projection rows of KV heads replicated because num_kv_heads < t)."""
    h, inter, vocab, layers = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q_local = cfg.num_attention_heads // t
    per_layer = (
        h * (q_local + 2 * kv_heads_local) * hd  # fused QKV, column-parallel
        + q_local * hd * h  # o_proj, row-parallel
        + h * 2 * inter // t
        + inter // t * h  # gate/up column-, down row-parallel
        + 2 * h
    )  # two RMSNorms, replicated
    heads = 1 if cfg.tie_word_embeddings else 2  # embedding (+ untied LM head), vocab-parallel
    return 4 * (layers * per_layer + heads * (-(-vocab // t)) * h + h)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "name, kv_split",
    [
        # 4 query heads, 1 KV head, tied embeddings: the KV head cannot be split 2 ways, so both ranks keep it
        # (each rank's 2 query heads read it); the KV cache per rank is the replicated one-head share.
        ("llama_tied_mqa", "replicated"),
        # GQA 8 query / 2 KV heads: 4 query heads and 1 KV head per rank; the KV cache per rank is half.
        ("llama_gqa", "split"),
    ],
)
def test_tp2_matches_tp1_token_for_token_with_half_the_weights_per_rank(tp_model_factory, name, kv_split):
    model_dir, hf_model = tp_model_factory(name)
    cfg = hf_model.config
    prompts, params = _workload(cfg.vocab_size)
    # The KV budget is per rank (per GPU, as the operator plans it). Same bytes for both runs.
    budget = 64 * 16 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * 8 * 4
    kw = dict(COMMON, kv_cache_bytes=budget)

    with LLM(model_dir, **kw) as llm1:
        ref_tokens, ref_logprobs = _run(llm1, prompts, params)
        runner = llm1.engine.executor.runner
        t1_param_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        t1_blocks = runner.num_blocks
        t1_kv_bytes_per_block = runner.kv_bytes_per_block()

    with LLM(model_dir, tensor_parallel_size=2, **kw) as llm2:
        tokens, logprobs = _run(llm2, prompts, params)
        info = llm2.engine.executor.describe_ranks()
        stats = llm2.engine.get_stats()
        startup_phases = llm2.engine.executor.startup_phases  # rank 0's (runtime/startup_phases.py)

    assert tokens == ref_tokens
    # logprobs come from rank 0's gathered logits: same top tokens, values equal up to fp32 reduction order
    for ours, ref in zip(logprobs[2], ref_logprobs[2]):
        assert list(ours) == list(ref)
        for tok in ref:
            assert ours[tok].logprob == pytest.approx(ref[tok].logprob, abs=1e-4)
    assert stats.prefix_cache_hits > 0

    assert [i.rank for i in info] == [0, 1] and info[0].pid != info[1].pid
    assert (
        {"distributed_init", "weight_load", "kv_cache_allocate", "warmup"}
        <= set(startup_phases)
        == set(info[0].startup_phases) | {"warmup"}  # the engine core times the warm-up over all ranks
    )
    kv_local = 1
    if kv_split == "replicated":
        assert [i.kv_head_ids for i in info] == [[0], [0]]
    else:
        assert [i.kv_head_ids for i in info] == [[0], [1]]
    for i in info:
        # Weights: about half per rank, exactly what the split predicts (measured on the worker's tensors).
        assert i.param_bytes == _expected_rank_param_bytes(cfg, 2, kv_local)
        assert 0.5 <= i.param_bytes / t1_param_bytes < 0.53  # + replicated norms (and MQA K/V rows)
        # KV: per block, a rank holds only its KV heads -> half of t=1's block with 2 KV heads split, all
        # of it when the single KV head is replicated. The same per-rank byte budget therefore holds 2x
        # the blocks (tokens) in the split case.
        per_block = i.kv_tensor_bytes / i.num_blocks
        if kv_split == "split":
            assert per_block == t1_kv_bytes_per_block / 2
            assert i.num_blocks == 2 * t1_blocks
        else:
            assert per_block == t1_kv_bytes_per_block
            assert i.num_blocks == t1_blocks
        assert i.kv_tensor_bytes <= budget


@pytest.mark.timeout(120)
def test_tp2_swap_preemption_matches_unconstrained_tp1(tp_model_factory):
    """A pool small enough to force preemption, in swap mode: every rank swaps its own KV heads out to host
    memory and back (swap_space_bytes is per rank too), and the output equals an unconstrained t=1 run."""
    model_dir, hf_model = tp_model_factory("llama_gqa")
    prompts = [{"prompt_token_ids": p} for p in random_prompts(8, hf_model.config.vocab_size, 20, 60, seed=1)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(model_dir, max_model_len=128) as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(
        model_dir,
        max_model_len=128,
        num_kv_blocks=14,
        preemption_mode="swap",
        swap_space_bytes=1 << 20,
        tensor_parallel_size=2,
    ) as llm:
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.get_stats()
    assert out == ref
    assert stats.num_swap_outs > 0 and stats.num_swap_ins == stats.num_swap_outs
    assert stats.num_free_host_blocks == stats.num_total_host_blocks > 0
    assert stats.num_free_blocks == stats.num_total_blocks

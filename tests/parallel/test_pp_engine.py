"""pipeline_parallel_size > 1 on CPU/gloo worker processes: greedy output token-identical to one stage (over
chunked prefill, prefix-cache hits, preemption, a seeded sample and logprobs), and each stage holding exactly
its own layers' weights and KV, as runtime/capacity/ plans them (measured on the workers' tensors)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from kvserve_testing import TEST_MODEL_CONFIGS, random_prompts

from kvserve.runtime import LLM, SamplingParams, capacity
from kvserve.runtime.errors import WorkerDiedError

MAX_MODEL_LEN = 256
# Small token budget: long prompts are chunked, so the stages also agree across chunked prefill.
COMMON = dict(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64, max_num_seqs=8, seed=0)


@pytest.fixture(scope="module")
def four_layer_model(tmp_path_factory):
    """GQA Llama (8 q / 2 KV heads) with 4 decoder layers, so stages can be uneven; and a tied-embedding MQA
    one (4 q / 1 KV head), whose last stage needs its own copy of the embedding as the LM head."""
    from kvserve.runtime.models.synthetic import make_random_model_dir

    out = {}
    for name in ("llama_gqa", "llama_tied_mqa"):
        arch, kwargs = TEST_MODEL_CONFIGS[name]
        path = str(tmp_path_factory.mktemp(f"pp-{name}"))
        out[name] = (path, make_random_model_dir(path, arch, seed=1234, **dict(kwargs, num_hidden_layers=4)))
    return out


def _workload(vocab: int, n: int = 5):
    prompts = random_prompts(n, vocab, 4, 90, seed=3)
    prompts.append(prompts[0][:40] + [7, 8, 9])  # shares full blocks with prompts[0]: prefix-cache hits
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True) for _ in prompts]
    params[1] = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True)
    params[2] = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    return [{"prompt_token_ids": p} for p in prompts], params


def _run(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def _stage_param_bytes(model, layers: range, first: bool, last: bool) -> int:
    """Bytes of the one-stage model's own parameters that a stage owning `layers` must hold."""
    tied = model.lm_head is None
    total = 0
    for name, p in model.named_parameters():
        if name.startswith("layers."):
            keep = int(name.split(".")[1]) in layers
        elif name.startswith("embed_tokens."):
            keep = first or (last and tied)
        else:  # norm, lm_head
            keep = last
        total += p.numel() * p.element_size() if keep else 0
    return total


@pytest.mark.timeout(180)
def test_pp2_uneven_split_matches_one_stage_and_holds_only_its_layers(four_layer_model):
    model_dir, hf_model = four_layer_model["llama_gqa"]
    cfg = hf_model.config
    prompts, params = _workload(cfg.vocab_size)
    budget = 48 * 16 * 2 * 4 * cfg.num_key_value_heads * 8 * 4  # per rank: 48 blocks of all 4 layers' KV
    kw = dict(COMMON, kv_cache_bytes=budget)

    with LLM(model_dir, **kw) as llm1:
        ref_tokens, ref_logprobs = _run(llm1, prompts, params)
        model1 = llm1.engine.executor.runner.model
        one_stage_bytes = sum(p.numel() * p.element_size() for p in model1.parameters())
        expected = [_stage_param_bytes(model1, r, s == 0, s == 1) for s, r in enumerate((range(0, 3), range(3, 4)))]
        shape = llm1.engine.config.model.shape

    # --pipeline-layer-split 3,1: stage 0 owns layers 0-2 and the embedding, stage 1 layer 3, norm and head.
    with LLM(model_dir, pipeline_parallel_size=2, pipeline_layer_split="3,1", **kw) as llm2:
        tokens, logprobs = _run(llm2, prompts, params)
        info = llm2.engine.executor.describe_ranks()
        stats = llm2.engine.get_stats()

    assert tokens == ref_tokens
    for ours, ref in zip(logprobs[2], ref_logprobs[2]):  # the last stage's logits are the one stage's
        assert list(ours) == list(ref)
        for tok in ref:
            assert ours[tok].logprob == pytest.approx(ref[tok].logprob, abs=1e-5)
    assert stats.prefix_cache_hits > 0

    assert [(i.rank, i.stage, i.layers) for i in info] == [(0, 0, (0, 3)), (1, 1, (3, 4))]
    assert info[0].pid != info[1].pid
    # Weights: exactly the stage's own tensors; together exactly the one-stage model.
    assert [i.param_bytes for i in info] == expected
    assert sum(expected) == one_stage_bytes
    for i, layers in zip(info, (range(0, 3), range(3, 4))):
        first, last = i.stage == 0, i.stage == 1
        # ... and what the capacity plan (kvserve plan / the operator) predicts for that stage.
        assert i.param_bytes == capacity.stage_weight_bytes_per_rank(shape, "float32", 1, layers, first, last)
        # KV: a block holds only the stage's layers, the capacity formula's bytes per token x block size.
        per_token = capacity.stage_kv_bytes_per_token_per_rank(shape, "float32", "auto", 1, layers)
        assert i.kv_tensor_bytes == i.num_blocks * 16 * per_token <= budget
    # One block table for both stages: the stage with the least room per block (3 layers) decides.
    assert info[0].num_blocks == info[1].num_blocks == budget // (16 * 2 * 3 * 2 * 8 * 4)


@pytest.mark.timeout(240)
def test_tp2_x_pp2_matches_one_process_under_preemption(four_layer_model):
    """4 gloo ranks (2 stages x 2 TP ranks), tied embeddings, the pure-torch path (no fused residual stream),
    and a KV pool small enough to force recompute preemption: still token-identical to one process."""
    model_dir, hf_model = four_layer_model["llama_tied_mqa"]
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, hf_model.config.vocab_size, 20, 60, seed=1)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    kw = dict(max_model_len=128, attention_backend="torch")
    with LLM(model_dir, **kw) as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(model_dir, tensor_parallel_size=2, pipeline_parallel_size=2, num_kv_blocks=14, **kw) as llm:
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.get_stats()
        info = llm.engine.executor.describe_ranks()
    assert out == ref
    assert stats.num_preemptions > 0
    assert [(i.stage, i.tp_rank, i.layers) for i in info] == [
        (0, 0, (0, 2)),
        (0, 1, (0, 2)),
        (1, 0, (2, 4)),
        (1, 1, (2, 4)),
    ]
    assert [i.kv_head_ids for i in info] == [[0]] * 4  # the one KV head, replicated over the TP ranks
    assert all(i.num_blocks == 14 for i in info)


@pytest.mark.timeout(120)
def test_last_stage_killed_mid_generate_raises_naming_the_rank(four_layer_model):
    """Stage 0 may be blocked sending to the dead stage: the executor waits on process sentinels, not on the
    collective, so it notices at once, stops stage 0 too, and names the dead rank."""
    model_dir, _ = four_layer_model["llama_gqa"]
    llm = LLM(model_dir, max_model_len=256, num_kv_blocks=160, pipeline_parallel_size=2)
    try:
        executor = llm.engine.executor
        prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8]} for i in range(8)]
        threading.Timer(0.5, os.kill, (executor.worker_pids[1], signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"pipeline-parallel worker rank 1 \(pid \d+\) .*(SIGKILL|not reach)"):
            llm.generate(prompts, SamplingParams(max_tokens=240, ignore_eos=True), use_tqdm=False)
        assert time.monotonic() - start < 30
        with pytest.raises(WorkerDiedError):
            llm.engine.check_health()
    finally:
        llm.shutdown()


def test_pp2_structured_outputs_equal_one_stage():
    """Structured outputs with PP=2 (issue 28 scope: grammars are applied where the last stage's logits are
    sampled): on the pretrained stories260K, a JSON schema and a regex, greedy and a seeded temperature-1.0
    sample, give the same tokens as one stage, and the outputs hold their grammar."""
    import json
    import re

    import jsonschema
    from kvserve_testing import STORIES_DIR

    from kvserve.runtime.structured_output import StructuredOutputSpec

    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "age"],
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    }
    regex = r"(red|blue|green) (cat|dog)\."
    json_spec = StructuredOutputSpec.from_request("json", schema, "structured_outputs")
    regex_spec = StructuredOutputSpec.from_request("regex", regex, "structured_outputs")
    prompts = ["Once upon a time", "Lily saw a", "Once upon a time", "Tom had a"]
    params = [
        SamplingParams(temperature=0, max_tokens=64, structured_outputs=json_spec),
        SamplingParams(temperature=0, max_tokens=16, structured_outputs=regex_spec),
        SamplingParams(temperature=1.0, seed=11, max_tokens=64, structured_outputs=json_spec),
        SamplingParams(temperature=1.0, seed=12, max_tokens=16, structured_outputs=regex_spec),
    ]
    outs = {}
    for pp in (1, 2):
        with LLM(str(STORIES_DIR), pipeline_parallel_size=pp, **COMMON) as llm:
            outs[pp] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [c.token_ids for c in outs[2]] == [c.token_ids for c in outs[1]]
    for i, c in enumerate(outs[2]):
        assert c.finish_reason == "stop", c.text
        if i % 2 == 0:
            jsonschema.validate(json.loads(c.text), schema)
        else:
            assert re.fullmatch(regex, c.text), c.text

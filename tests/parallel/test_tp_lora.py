"""Multi-LoRA with tensor_parallel_size=2 (issue 24; gloo/CPU, fp32, random weights, random adapters with
non-zero B): one generate() call mixing two adapters (r=8, and r=4 rsLoRA; all seven targets) and the base
model is token-identical to HF transformers + peft per row, and an adapter loaded at run time through the
engine core's registry reaches both ranks (its tokens equal peft's too), then unloads.

The model has 4 query heads and 1 KV head: at t=2 the KV head is replicated on both ranks, so the k/v
adapters' B rows are replicated too, while q's are split; o/down split A by input columns and rely on the
layer's all-reduce to sum the partial products (lora/tp_shard.py). A split GQA layout is covered by
tests/runtime/test_lora_tp_shard.py without processes."""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")

from kvserve_testing import make_peft_adapter  # noqa: E402

from kvserve.runtime import LLM, SamplingParams  # noqa: E402

STEPS = 6


def _greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(STEPS):
            logits = model(input_ids=ids, use_cache=False).logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.mark.timeout(240)
def test_tp2_mixed_adapters_match_peft_and_runtime_load_reaches_every_rank(tp_model_factory, tmp_path):
    model_dir, hf_model = tp_model_factory("llama_tied_mqa")
    paths = {n: str(tmp_path / n) for n in ("a1", "a2", "a3")}
    refs = {
        None: hf_model.eval(),
        "a1": make_peft_adapter(hf_model, paths["a1"], r=8, alpha=16, seed=1),
        "a2": make_peft_adapter(hf_model, paths["a2"], r=4, alpha=8, seed=2, rslora=True),
        "a3": make_peft_adapter(hf_model, paths["a3"], r=8, alpha=8, seed=3),
    }
    prompts = [[5, 17, 33, 2, 8], [9, 40, 3, 77], [1, 2, 3, 4, 5, 6], [5, 17, 33, 2, 8]]
    names = ["a1", None, "a2", None]  # a1's prompt again on the base model: the adapter must change the tokens
    expected = [_greedy(refs[n], p) for p, n in zip(prompts, names)]
    assert expected[0] != expected[3]
    runtime_expected = _greedy(refs["a3"], prompts[2])
    assert runtime_expected != expected[2] and runtime_expected != _greedy(refs[None], prompts[2])

    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    with LLM(
        model_dir,
        tensor_parallel_size=2,
        max_model_len=64,
        num_kv_blocks=64,
        block_size=16,
        enable_lora=True,
        lora_modules=f"a1={paths['a1']},a2={paths['a2']}",
        max_loras=2,
        max_lora_rank=8,
        max_cpu_loras=3,
    ) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=names)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected

        registry = llm.engine.core.lora_registry
        assert registry.load("a3", paths["a3"]) == {"a1": paths["a1"], "a2": paths["a2"], "a3": paths["a3"]}
        # a3 with a base row and a1 in the same step: a3 takes a1's or a2's device slot (max_loras=2) on both ranks
        outs = llm.generate(prompts[:3], params, use_tqdm=False, lora_request=["a1", None, "a3"])
        assert [list(o.outputs[0].token_ids) for o in outs] == [expected[0], expected[1], runtime_expected]
        registry.unload("a3")
        assert registry.identity("a3") is None and "a3" not in llm.engine.executor.lora.cpu
        outs = llm.generate(prompts[2:3], params, use_tqdm=False, lora_request="a2")
        assert list(outs[0].outputs[0].token_ids) == expected[2]

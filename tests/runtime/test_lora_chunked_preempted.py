"""LoRA under chunked prefill and preemption (issue 24 scope 1): a batch mixing the base model and two
adapters, run with a token budget that splits every prompt into chunks and a KV pool so small that requests
are preempted and recomputed, gives each request exactly the tokens it gets alone with room to spare (the
unpressured engine is itself token-identical to HF + peft: test_lora_peft_parity.py)."""

from __future__ import annotations

from kvserve_testing import STORIES_DIR

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.models.synthetic import make_random_adapter_dir

PROMPTS = [[1] + [(7 * i + 11 * j) % 500 + 3 for j in range(40)] for i in range(6)]  # 41 tokens: 3 blocks
NAMES = ["a", None, "b", "a", None, "b"]


def test_chunked_prefill_and_preemption_keep_every_adapters_tokens(tmp_path):
    modules = ",".join(
        f"{n}={make_random_adapter_dir(str(STORIES_DIR), str(tmp_path / n), rank=r, seed=s)}"
        for n, r, s in (("a", 8, 1), ("b", 4, 2))
    )
    lora = dict(enable_lora=True, lora_modules=modules, max_loras=2, max_lora_rank=8, dtype="float32", seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    roomy = LLM(str(STORIES_DIR), max_model_len=64, num_kv_blocks=64, block_size=16, **lora)
    alone = [
        list(roomy.generate([p], params, use_tqdm=False, lora_request=[n])[0].outputs[0].token_ids)
        for p, n in zip(PROMPTS, NAMES)
    ]
    roomy.shutdown()
    assert alone[0] != alone[1] != alone[2]  # the adapters change the tokens: a dropped delta cannot pass

    # 16 tokens a step: every 41-token prompt is prefilled in 3 chunks, often beside other requests' decodes;
    # 12 blocks for 6 requests that grow to 4 blocks each: the scheduler must preempt and recompute.
    tight = LLM(str(STORIES_DIR), max_model_len=64, num_kv_blocks=12, block_size=16, max_num_batched_tokens=16, **lora)
    outs = tight.generate(PROMPTS, params, use_tqdm=False, lora_request=NAMES)
    stats = tight.engine.get_stats()
    tight.shutdown()
    assert stats.num_preemptions > 0
    assert [list(o.outputs[0].token_ids) for o in outs] == alone

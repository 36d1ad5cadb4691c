"""Helpers of the KV offload tests (tests/runtime/test_kv_offload.py, test_kv_disk_tier.py): a multi-turn
workload and an engine run that counts what the forward computed."""

from __future__ import annotations

import random

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.core.kv_cache_events import KVEventCollector

MAX_NEW = 8
BLOCK = 16
BYTES_PER_BLOCK = BLOCK * 256  # llama_gqa, float32: 256 bytes of KV per token
GIB = 1 << 30


def conversations(num: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """A shared system prompt (3 blocks) and per-conversation questions; round 2 re-asks each conversation
    with a follow-up (round 1's prompt + a stand-in answer + a new question)."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 512) for _ in range(3 * BLOCK)]
    first = [system + [rng.randrange(3, 512) for _ in range(rng.randint(20, 40))] for _ in range(num)]
    second = [p + [rng.randrange(3, 512) for _ in range(rng.randint(5, 20))] for p in first]
    return first, second


def run_rounds(model_dir, rounds, offload_bytes: int, names=None, max_tokens=MAX_NEW, **kwargs):
    """Each round's prompts as one batch; returns the tokens per round, the engine and the tokens computed."""
    observed = []
    llm = LLM(
        model_dir,
        max_model_len=kwargs.pop("max_model_len", 256),
        block_size=BLOCK,
        num_kv_blocks=kwargs.pop("num_kv_blocks", 18),
        kv_offloading_size=offload_bytes / GIB if offload_bytes else None,
        **kwargs,
    )
    llm.engine.core.step_observers.append(lambda sched, _s: observed.append(sum(len(s.token_ids) for s in sched)))
    llm.engine.core.kv_cache_manager.pool.events = events = KVEventCollector()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokens = []
    for prompts in rounds:
        extra = {} if names is None else {"lora_request": names}
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, **extra)
        tokens.append([o.outputs[0].token_ids for o in outs])
    llm.engine.events = events.take()
    return tokens, llm.engine, sum(observed)

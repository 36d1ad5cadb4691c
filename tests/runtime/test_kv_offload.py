"""The host KV tier (--kv-offloading-size): greedy tokens identical with the tier on and off on a multi-turn
workload whose prefixes do not fit the device pool, and prefix blocks coming back from host RAM instead of
being recomputed."""

from __future__ import annotations

import random

import pytest
from kvserve_testing import STORIES_DIR
from prometheus_client import generate_latest

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.core.kv_cache_events import KVEventCollector, StoredBlocks
from kvserve.runtime.metrics import ServerMetrics
from kvserve.runtime.models.synthetic import make_random_adapter_dir

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


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory("llama_gqa")[0]


def test_tier_on_matches_off_and_loads_instead_of_recomputing(model_dir):
    rounds = conversations(12, seed=3)
    off, engine_off, computed_off = run_rounds(model_dir, rounds, 0)
    on, engine, computed_on = run_rounds(model_dir, rounds, 256 * BYTES_PER_BLOCK)
    assert on == off
    kv = engine.kv_cache_manager
    loaded = engine.scheduler.num_offload_loaded_tokens
    assert loaded > 0 and kv.host.num_loaded_blocks * BLOCK == loaded
    assert kv.host.num_saved_blocks > 0
    # Every loaded token is one the forward did not compute.
    assert computed_on < computed_off
    assert engine_off.kv_cache_manager.tier is None and engine_off.scheduler.num_offload_loaded_tokens == 0
    # KV events: the host tier's stores carry medium CPU, the device's none (the publisher's GPU).
    media = {e.medium for e in engine.events if isinstance(e, StoredBlocks)}
    assert media == {None, "CPU"}
    # Prometheus: per tier, hits and bytes moved.
    stats = engine.get_stats()
    assert stats.kv_offload_loaded_blocks * BLOCK == loaded and stats.kv_offload_block_bytes == BYTES_PER_BLOCK
    metrics = ServerMetrics("m", 256)
    metrics.update_from_stats(stats)
    text = generate_latest(metrics.registry).decode()
    hits = f'kvserve:kv_offload_hit_blocks_total{{engine="0",model_name="m",tier="cpu"}} {float(loaded // BLOCK)}'
    assert hits in text
    loaded_bytes = float(loaded // BLOCK * BYTES_PER_BLOCK)
    assert f'kvserve:kv_offload_bytes_total{{engine="0",model_name="m",op="load",tier="cpu"}} {loaded_bytes}' in text


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tier_under_preemption(model_dir, mode):
    """17 blocks and 40 new tokens per request: requests are preempted (swapped or recomputed) while the tier
    saves and loads; one host pool serves both (swap evicts tier entries when it needs their room)."""
    rounds = conversations(8, seed=5)
    kwargs = dict(max_num_batched_tokens=64, preemption_mode=mode, max_tokens=40)
    if mode == "swap":
        kwargs["swap_space_bytes"] = 32 * BYTES_PER_BLOCK
    off, engine_off, _ = run_rounds(model_dir, rounds, 0, **kwargs)
    on, engine, _ = run_rounds(model_dir, rounds, 64 * BYTES_PER_BLOCK, **kwargs)
    assert on == off
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.num_offload_loaded_tokens > 0
    if mode == "swap":
        assert engine.scheduler.num_swap_outs > 0
        assert engine.kv_cache_manager.host.num_blocks == 96  # one pool: swap space + tier
    assert not engine.kv_cache_manager.req_to_host_blocks


def test_tier_with_lora_adapters(tmp_path):
    """The same conversations under two adapters and the base model: the adapter is part of every block's key,
    so the tier never hands one adapter's KV to another (tokens equal with the tier off)."""
    modules = ",".join(
        f"{n}={make_random_adapter_dir(str(STORIES_DIR), str(tmp_path / n), rank=4, seed=s)}"
        for n, s in (("a", 1), ("b", 2))
    )
    lora = dict(enable_lora=True, lora_modules=modules, max_loras=2, max_lora_rank=4, dtype="float32", seed=0)
    first, second = conversations(3, seed=9)
    first, second = [p[:60] for p in first] * 3, [p[:64] for p in second] * 3  # the same prompts per adapter
    names = [n for n in ("a", None, "b") for _ in range(3)]
    rounds = (first, second)
    off, _, _ = run_rounds(str(STORIES_DIR), rounds, 0, names=names, max_model_len=128, num_kv_blocks=10, **lora)
    on, engine, _ = run_rounds(
        str(STORIES_DIR), rounds, 32 << 20, names=names, max_model_len=128, num_kv_blocks=10, **lora
    )
    assert on == off
    assert on[0][0] != on[0][3] != on[0][6]  # the adapters change the tokens
    assert engine.scheduler.num_offload_loaded_tokens > 0

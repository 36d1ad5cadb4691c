"""Decode CUDA graphs (runtime/executor/cuda_graphs.py) on CPU: capture/replay emulated, kernels under the
Triton interpreter. What this checks is everything but the CUDA graph object itself: the static buffers,
padding a batch up to a captured size (slot -1, context length 1), metadata frozen at capture (split count
chosen for max_model_len while real contexts are short), dropped padded rows, eager fallback above the
largest size and for prefill/mixed steps. runtime/bench/gpu_serving.py checks the real graphs on a GPU."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from kvserve.runtime import (  # noqa: E402
    LLM,
    SamplingParams,
    cuda_graph_settings,  # noqa: E402
)

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kvserve_testing import TEST_MODEL_CONFIGS

    from kvserve.runtime.models.synthetic import make_random_model_dir

    arch, kwargs = TEST_MODEL_CONFIGS["llama_gqa"]
    out = str(tmp_path_factory.mktemp("llama_gqa"))
    make_random_model_dir(out, arch, seed=1234, dtype="float32", **kwargs)
    return out


@pytest.fixture
def emulate(monkeypatch):
    monkeypatch.setattr(cuda_graph_settings, "EMULATE_ON_CPU", True)


def _llm(model_dir, **kw):
    return LLM(
        model_dir,
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=64,
        block_size=16,
        attention_backend="triton",
        device="cpu",
        max_num_batched_tokens=64,
        **kw,
    )


def _run(llm, prompts, max_tokens):
    """Greedy; each request its own length, so the decode batch shrinks step by step (pads change)."""
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens],
        use_tqdm=False,
    )
    return [o.outputs[0].token_ids for o in outs]


def _record_sizes(graphs):
    """Wrap run() to record (num_seqs, padded size) per replayed step."""
    seen = []
    original = graphs.run

    def run(input_ids, *args):
        seen.append((len(input_ids), int(graphs._size_for[len(input_ids)])))
        return original(input_ids, *args)

    graphs.run = run
    return seen


def test_graph_replays_give_eager_tokens(model_dir, emulate):
    rng = random.Random(7)
    # 7 prompts (20-40 tokens, some crossing block boundaries), outputs of 3..12 tokens: pure-decode steps of
    # 6, 4, 3, 2, 1 sequences (the first ones decode beside the last prefills), padded to 8, 4, 4, 2, 1.
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(20, 41))] for _ in range(7)]
    max_tokens = [12, 3, 9, 5, 7, 4, 10]
    expected = _run(_llm(model_dir), prompts, max_tokens)

    llm = _llm(model_dir, cuda_graphs=True, cuda_graph_sizes="1,2,4,8")
    graphs = llm.engine.executor.runner.decode_graphs
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    seen = _record_sizes(graphs)
    assert _run(llm, prompts, max_tokens) == expected
    assert {size for _, size in seen} == {1, 2, 4, 8}, seen  # every graph replayed
    assert any(size > n for n, size in seen), "no step was padded"
    assert all(size == min(s for s in (1, 2, 4, 8) if s >= n) for n, size in seen)


def test_batches_above_the_largest_size_run_eagerly(model_dir, emulate):
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 512) for _ in range(25)] for _ in range(5)]
    max_tokens = [12, 2, 3, 4, 5]
    expected = _run(_llm(model_dir), prompts, max_tokens)
    llm = _llm(model_dir, cuda_graphs=True, cuda_graph_sizes="1,2")
    seen = _record_sizes(llm.engine.executor.runner.decode_graphs)
    assert _run(llm, prompts, max_tokens) == expected
    assert seen and max(n for n, _ in seen) <= 2  # 5, 4 and 3 decodes ran eagerly
    assert {n for n, _ in seen} == {1, 2}


def test_padded_rows_write_no_kv(model_dir, emulate):
    """A step of 3 decodes padded to 4 writes exactly 3 KV slots per layer: the real ones."""
    llm = _llm(model_dir, cuda_graphs=True, cuda_graph_sizes="4")
    engine, runner = llm.engine, llm.engine.executor.runner
    # A larger step first, so the padding row holds a stale real slot unless it is reset to -1.
    rng = random.Random(9)
    for i in range(4):
        engine.add_request(
            f"r{i}",
            {"prompt_token_ids": [rng.randrange(3, 512) for _ in range(18)]},
            SamplingParams(temperature=0, max_tokens=3 if i == 3 else 8, ignore_eos=True),
        )
    while engine.scheduler.num_running != 3 or any(
        r.num_computed_tokens < 18 for r in engine.scheduler.requests.values()
    ):
        engine.step()
    before = runner.kv.clone()
    engine.step()  # 3 decodes -> graph size 4
    changed = (runner.kv != before).reshape(2, runner.kv.shape[1], -1, runner.kv.shape[-2] * runner.kv.shape[-1])
    changed_slots = changed.any(-1)  # [k/v, layer, slot]
    per_layer = changed_slots.sum(-1)
    assert int(per_layer.max()) <= 3, per_layer
    assert int(per_layer[0].min()) == 3, per_layer  # every layer stored the 3 new keys
    assert not changed_slots[:, :, :16].any(), "the null block 0 was written"


def test_graph_buffers_reset_padding_between_steps(model_dir, emulate):
    """Unit: run() of 4 rows then 1 row (both padded to 4): rows 1..3 go back to slot -1 / length 1."""
    llm = _llm(model_dir, cuda_graphs=True, cuda_graph_sizes="4")
    graphs = llm.engine.executor.runner.decode_graphs
    with torch.inference_mode():  # as in ModelRunner.execute
        graphs.run(
            [5, 6, 7, 8],
            [20, 21, 22, 23],
            [40, 41, 42, 43],
            [21, 22, 23, 24],
            torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8]], dtype=torch.int32).numpy(),
        )
        assert graphs.slot_mapping[:4].tolist() == [40, 41, 42, 43]
        graphs.run([9], [30], [50], [31], torch.tensor([[9, 10]], dtype=torch.int32).numpy())
    assert graphs.slot_mapping[:4].tolist() == [50, -1, -1, -1]
    assert graphs.seq_lens[:4].tolist() == [31, 1, 1, 1]
    assert graphs.block_tables[0, :2].tolist() == [9, 10]

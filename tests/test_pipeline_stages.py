"""Pipeline-parallel stage layout and per-stage capacity in runtime.capacity (issue 28), pure arithmetic."""

import dataclasses

import pytest

from kvserve.runtime import capacity
from kvserve.runtime.capacity import (
    kv_tokens_per_rank,
    stage_kv_bytes_per_token_per_rank,
    stage_layer_ranges,
    stage_weight_bytes_per_rank,
)
from kvserve.runtime.planner.catalog import MODELS


def test_balanced_split_by_layer_count():
    assert stage_layer_ranges(126, 2) == (range(0, 63), range(63, 126))
    assert [len(r) for r in stage_layer_ranges(10, 4)] == [3, 3, 2, 2]
    assert stage_layer_ranges(5, 1) == (range(0, 5),)


def test_override_split_and_errors_name_the_setting():
    assert stage_layer_ranges(10, 2, (4, 6)) == (range(0, 4), range(4, 10))
    with pytest.raises(ValueError, match="pipeline_layer_split"):
        stage_layer_ranges(10, 2, (4, 5))
    with pytest.raises(ValueError, match="pipeline_layer_split has 3"):
        stage_layer_ranges(10, 2, (4, 3, 3))
    with pytest.raises(ValueError, match="pipeline_parallel_size=11"):
        stage_layer_ranges(10, 11)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be >= 1"):
        stage_layer_ranges(10, 0)


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_stage_weights_sum_to_the_unsplit_model(dtype, pp):
    """Untied model: stages partition the weights exactly (embedding first, norm + head last)."""
    shape = MODELS["llama-3.1-405b"]
    ranges = stage_layer_ranges(shape.num_layers, pp)
    total = sum(stage_weight_bytes_per_rank(shape, dtype, 8, r, s == 0, s == pp - 1) for s, r in enumerate(ranges))
    assert total == capacity.weight_bytes_per_rank(shape, dtype, 8)


def test_tied_head_is_a_second_copy_on_the_last_stage():
    shape = dataclasses.replace(MODELS["llama-3.1-405b"], tie_word_embeddings=True)
    ranges = stage_layer_ranges(shape.num_layers, 2)
    total = sum(stage_weight_bytes_per_rank(shape, "bfloat16", 8, r, s == 0, s == 1) for s, r in enumerate(ranges))
    table = shape.vocab_size // 8 * shape.hidden_size * 2
    assert total == capacity.weight_bytes_per_rank(shape, "bfloat16", 8) + table


def test_kv_per_stage_is_its_own_layers_and_the_smallest_stage_decides():
    shape = MODELS["llama-3.1-405b"]
    full = stage_kv_bytes_per_token_per_rank(shape, "bfloat16", "auto", 8, range(shape.num_layers))
    half = stage_kv_bytes_per_token_per_rank(shape, "bfloat16", "auto", 8, range(63))
    assert full == 2 * half
    # 405B bf16 does not fit TP=8 on 80 GB GPUs, fits TP=8 x PP=2 (two 8-GPU nodes).
    gpu = 80 * 10**9
    assert capacity.weight_bytes_per_rank(shape, "bfloat16", 8) > gpu
    tokens, stage = kv_tokens_per_rank(shape, "bfloat16", "auto", 8, 2, gpu)
    assert tokens > 100_000
    # An uneven split moves the bottleneck to the stage holding more layers.
    _, heavy = kv_tokens_per_rank(shape, "bfloat16", "auto", 8, 2, gpu, (53, 73))
    assert heavy == 1
    _, heavy = kv_tokens_per_rank(shape, "bfloat16", "auto", 8, 2, gpu, (73, 53))
    assert heavy == 0


def test_plan_for_405b_chooses_pp_x_tp_instead_of_refusing():
    from kvserve.runtime.planner.catalog import GiB
    from kvserve.runtime.planner.kv_plan import PlanInput, plan, plan_multinode

    inp = PlanInput(MODELS["llama-3.1-405b"], 80 * GiB, tensor_parallel_size=8, max_model_len=8192)
    assert not plan(inp).fits
    chosen, why = plan_multinode(inp, gpus_per_node=8)
    assert chosen.fits, chosen.message
    assert (chosen.tensor_parallel_size, chosen.pipeline_parallel_size) == (8, 2)
    assert "PP 2" in why and "pipeline stages" in chosen.message
    # An 8B model still fits one node and keeps PP 1.
    small, _ = plan_multinode(PlanInput(MODELS["llama-3.1-8b"], 80 * GiB, max_model_len=8192), 8)
    assert small.fits and small.pipeline_parallel_size == 1


def test_kvserve_plan_cli_answers_405b_with_a_pp_x_tp_layout(capsys):
    import argparse
    import json

    from kvserve.cli import plan as plan_cli

    parser = argparse.ArgumentParser()
    plan_cli.add_arguments(parser)
    args = parser.parse_args(
        ["--model", "llama-3.1-405b", "--gpu", "h100-80gb", "--tensor-parallel-size", "8", "--max-model-len", "8192"]
        + ["-o", "json"]
    )
    assert plan_cli.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["pipeline_parallel_size"] == 2 and out["tensor_parallel_size"] == 8
    assert "fewest stages that fit" in out["layout_reason"]


def test_kvserve_plan_at_a_smaller_tp_points_at_the_pp_x_tp_layout(capsys):
    # The default --tensor-parallel-size 1 stays a refusal (one pod per replica was asked for), in one line
    # that names the layout the suggested TP gets; following the hint answers with exactly that layout.
    from kvserve.cli.main import main

    base = ["plan", "--model", "llama-3.1-405b", "--gpu", "h100-80gb", "--max-model-len", "8192"]
    assert main(base) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].endswith("--tensor-parallel-size 8 would fit as TP 8 x PP 2 across 2 nodes")
    assert main([*base, "--tensor-parallel-size", "8"]) == 0
    assert "layout: TP 8 x PP 2:" in capsys.readouterr().out

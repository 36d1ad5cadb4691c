"""`kvserve plan` and `kvserve render` through the real CLI dispatcher."""

from __future__ import annotations

import json
import pathlib

import pytest
import yaml

from kvserve.cli.main import main
from kvserve.operator import spec as spec_mod

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_plan_json_matches_the_planner(capsys):
    rc = main(["plan", "--model", "llama-3-70b", "--gpu", "a100-80gb", "--tensor-parallel-size", "4", "-o", "json"])
    out = json.loads(capsys.readouterr().out)
    # `kvserve serve`'s defaults, not the operator's: the catalog's 8,192 positions, 2048 batched tokens (chunked
    # prefill); a catalog model has no config.json, so dtype auto plans the operator's bfloat16.
    assert out.pop("engine") == {
        "dtype": "bfloat16",
        "max_model_len": 8192,
        "max_num_batched_tokens": 2048,
        "max_num_seqs": 256,
        "block_size": 16,
        "kv_cache_dtype": "auto",
        "enable_chunked_prefill": True,
        "tensor_parallel_size": 4,
        "gpu_memory_utilization": 0.9,
    }
    expected = spec_mod.resolve(
        {
            "model": {"name": "llama-3-70b", "uri": "file:///m"},
            "gpu": {"product": "a100-80gb", "tensorParallelSize": 4},
            "engine": {"maxNumBatchedTokens": 2048},
        }
    ).plan.to_dict()
    assert rc == 0 and out == expected
    assert out["kv_bytes_per_token"] == 327_680 and out["fits"]


def test_plan_table_prints_the_seed_numbers(capsys):
    rc = main(["plan", "--model", "llama-3-70b", "--gpu", "a100-80gb", "-tp", "4", "--max-model-len", "32768"])
    out = capsys.readouterr().out
    assert rc == 2  # llama-3-70b (not 3.1) has 8,192 positions: a 32k context is refused as `kvserve serve` does
    assert "error: max_model_len: max_model_len must be in [1, 8192]" in out
    rc = main(
        [
            "plan",
            "--model",
            "llama-3-70b",
            "--gpu",
            "a100-80gb",
            "-tp",
            "4",
            "--max-model-len",
            "8192",
            "--gpu-memory-utilization",
            "0.92",
            "--activation-reserve-mib",
            "0",
            "--runtime-overhead-mib",
            "0",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "327,680 B (320 KiB)" in out
    assert "engine: tensor-parallel-size 4, dtype bfloat16, max-model-len 8192," in out
    rc = main(
        [
            "plan",
            "--model",
            "llama-3.1-70b",
            "--gpu",
            "NVIDIA-A100-SXM4-80GB",
            "-tp",
            "4",
            "--max-model-len",
            "32768",
            "--gpu-memory-utilization",
            "0.92",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "max concurrency at 32,768 tokens" in out and "fits                                 True" in out


def test_plan_unknown_model_and_impossible_fit(capsys):
    assert main(["plan", "--model", "gpt-5", "--gpu", "l4"]) == 2
    assert "not in the catalog" in capsys.readouterr().out
    assert main(["plan", "--model", "llama-3-70b", "--gpu", "l4", "-o", "json"]) == 1
    assert json.loads(capsys.readouterr().out)["reason"] == "WeightsDoNotFit"


def test_render_prints_the_operator_children(capsys, tmp_path):
    rc = main(["render", "-f", str(ROOT / "examples" / "llama70b.yaml")])
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert rc == 0
    assert [d["kind"] for d in docs] == [
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "NetworkPolicy",
    ]
    bad = tmp_path / "bad.yaml"
    doc = yaml.safe_load((ROOT / "examples" / "llama70b.yaml").read_text())
    doc["spec"]["gpu"]["tensorParallelSize"] = 1
    bad.write_text(yaml.safe_dump_all([doc, yaml.safe_load((ROOT / "examples" / "llama3-8b-l4.yaml").read_text())]))
    rc = main(["render", "-f", str(bad), "-o", "json"])
    captured = capsys.readouterr()
    assert rc == 1 and "WeightsDoNotFit" in captured.err
    items = json.loads(captured.out)["items"]
    assert {i["metadata"]["name"] for i in items} == {"llama3-8b"}  # the fitting one still renders


@pytest.mark.parametrize("example,nodes", [("llama405b-multinode.yaml", 2), ("llama3-8b-l4.yaml", 1)])
def test_plan_file_json_carries_the_parallel_layout(example, nodes, capsys):
    """`kvserve plan -f` JSON: pods per replica, TP per pod, PP stages and each stage's layers as data (the
    --model form's tensor/pipeline_parallel_size), in status.parallelism's field names."""
    path = ROOT / "examples" / example
    assert main(["plan", "-f", str(path), "-o", "json"]) == 0
    layout = json.loads(capsys.readouterr().out)["parallelism"]
    resolved = spec_mod.resolve(yaml.safe_load(path.read_text())["spec"])
    assert layout["nodes"] == nodes == layout["pipelineParallelSize"]
    assert layout["gpusPerReplica"] == nodes * layout["tensorParallelSize"]
    assert layout["tensorParallelSize"] == resolved.plan_input.tensor_parallel_size
    assert len(layout["stageLayers"]) == nodes and sum(layout["stageLayers"]) == resolved.model.num_layers
    assert layout["reason"]

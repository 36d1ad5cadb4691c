"""--cuda-graphs / --cuda-graph-sizes validation (config.py, cuda_graph_settings.py) and --load-format dummy."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from kvserve.runtime import cuda_graph_settings
from kvserve.runtime.config import make_engine_config
from kvserve.runtime.cuda_graph_settings import default_capture_sizes
from kvserve.runtime.errors import InvalidParameter


def _error(model_dir, **kw) -> InvalidParameter:
    with pytest.raises(InvalidParameter) as info:
        make_engine_config(model_dir, device="cpu", max_model_len=64, **kw)
    return info.value


def test_default_ladder():
    assert default_capture_sizes(256) == (1, 2, 4) + tuple(range(8, 257, 8))
    assert default_capture_sizes(1000)[-1] == 512
    assert default_capture_sizes(20) == (1, 2, 4, 8, 16, 20)  # max_num_seqs itself is captured
    assert default_capture_sizes(3) == (1, 2, 3)


def test_cuda_graphs_need_cuda(model_factory):
    model_dir, _ = model_factory("llama_gqa")
    err = _error(model_dir, cuda_graphs=True, attention_backend="triton")
    assert "cuda_graphs" in str(err) and "CUDA device" in str(err)


@pytest.mark.parametrize(
    "name,kw,words",
    [
        ("llama_gqa", dict(attention_backend="torch"), "attention_backend 'triton'"),
        ("llama_gqa", dict(attention_backend="triton", tensor_parallel_size=2), "tensor_parallel_size 1"),
        ("gemma2_sliding", dict(attention_backend="triton"), "sliding-window"),
        ("mixtral_moe", dict(attention_backend="triton"), "mixture-of-experts"),
        ("llama_gqa", dict(attention_backend="triton", cuda_graph_sizes="1,2,999", max_num_seqs=64), "max_num_seqs"),
        ("llama_gqa", dict(attention_backend="triton", cuda_graph_sizes="1,x"), "positive integers"),
        ("llama_gqa", dict(attention_backend="triton", cuda_graph_sizes="0,4"), "positive integers"),
    ],
    ids=["torch-backend", "tp2", "sliding-window", "moe", "size-above-max-num-seqs", "not-int", "zero"],
)
def test_unsupported_settings_name_the_field(model_factory, monkeypatch, name, kw, words):
    monkeypatch.setattr(cuda_graph_settings, "EMULATE_ON_CPU", True)  # past the device check, to the one under test
    model_dir, _ = model_factory(name)
    err = _error(model_dir, cuda_graphs=True, **kw)
    assert words in str(err), str(err)
    assert str(err).startswith("cuda_graph"), str(err)


def test_sizes_without_the_flag(model_factory):
    model_dir, _ = model_factory("llama_gqa")
    assert "--cuda-graphs" in str(_error(model_dir, cuda_graph_sizes="1,2"))


def test_sizes_parsed_sorted_unique(model_factory, monkeypatch):
    monkeypatch.setattr(cuda_graph_settings, "EMULATE_ON_CPU", True)
    model_dir, _ = model_factory("llama_gqa")
    config = make_engine_config(
        model_dir,
        device="cpu",
        max_model_len=64,
        attention_backend="triton",
        cuda_graphs=True,
        cuda_graph_sizes="8, 2,2,1",
    )
    assert config.cuda_graph_sizes == (1, 2, 8)
    config = make_engine_config(
        model_dir, device="cpu", max_model_len=64, attention_backend="triton", cuda_graphs=True, max_num_seqs=16
    )
    assert config.cuda_graph_sizes == (1, 2, 4, 8, 16)
    assert make_engine_config(model_dir, device="cpu", max_model_len=64).cuda_graph_sizes == ()


def test_cli_flags(model_factory):
    import argparse

    from kvserve.runtime.engine_args import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--cuda-graphs", "--cuda-graph-sizes", "1,2,4", "--load-format", "dummy"])
    args = EngineArgs.from_cli_args("m", ns)
    assert (args.cuda_graphs, args.cuda_graph_sizes, args.load_format) == (True, "1,2,4", "dummy")
    with pytest.raises(SystemExit):
        parser.parse_args(["--load-format", "pt"])


# -- load_format="dummy" ---------------------------------------------------------------------------------
def _config_only_dir(model_dir, tmp_path):
    """config.json + tokenizer, no weights: what a shape-only benchmark directory holds."""
    out = tmp_path / "shape-only"
    out.mkdir()
    for name in os.listdir(model_dir):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(model_dir, name), out / name)
    return str(out)


@pytest.mark.parametrize(
    "name,dtype", [("llama_gqa", "auto"), ("llama_gqa", "fp8"), ("gemma2_sliding", "auto"), ("qwen3_moe", "auto")]
)
def test_dummy_weights_need_no_checkpoint(model_factory, tmp_path, name, dtype, monkeypatch):
    from kvserve.runtime import LLM, SamplingParams

    monkeypatch.setenv("KVSERVE_CPU_LINEAR", "aten")  # keep the plain weights readable (models/cpu_linear.py)

    model_dir, _ = model_factory(name)
    shape_only = _config_only_dir(model_dir, tmp_path)
    with pytest.raises(FileNotFoundError):  # the default format still needs the checkpoint
        LLM(shape_only, max_model_len=64, num_kv_blocks=16, device="cpu")
    llm = LLM(shape_only, max_model_len=64, num_kv_blocks=16, device="cpu", load_format="dummy", dtype=dtype)
    model = llm.engine.executor.runner.model
    params = dict(model.named_parameters())
    norms = [p for n, p in params.items() if n.endswith("layernorm.weight")]
    expected_norm = 0.0 if name.startswith("gemma") else 1.0  # Gemma stores the offset from 1
    assert norms and all(bool((p == expected_norm).all()) for p in norms)
    matrices = [p.detach().float() for p in params.values() if p.dim() >= 2 and p.dtype != torch.float8_e4m3fn]
    assert matrices and all(0.005 < float(p.std()) < 0.05 for p in matrices)
    assert all(bool(torch.isfinite(p.detach().float()).all()) for p in params.values())
    if dtype == "fp8":
        scales = [b for n, b in model.named_buffers() if n.endswith("weight_scale")]
        assert scales and all(bool((s == 0.02).all()) for s in scales)
    out = llm.generate(
        [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 4
    # Dummy weights are reproducible: the same seed gives the same tokens.
    again = LLM(shape_only, max_model_len=64, num_kv_blocks=16, device="cpu", load_format="dummy", dtype=dtype)
    out2 = again.generate(
        [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    assert out2[0].outputs[0].token_ids == out[0].outputs[0].token_ids
    assert json.load(open(os.path.join(shape_only, "config.json")))  # untouched

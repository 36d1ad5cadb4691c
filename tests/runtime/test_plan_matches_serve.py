"""`kvserve plan --model-config DIR` describes the server `kvserve serve DIR` starts (issue 22's Done-when).

The serve side is built in-process exactly as `kvserve serve` builds it (its own argument parser, then
EngineArgs.from_cli_args and build_engine_config; no server starts, no weights load), for small model
directories from tests/kvserve_testing.py's configs. The plan side is the real `kvserve plan ... -o json`. Every
engine setting a plan depends on (cli/plan.py's PLAN_SETTINGS) is compared field by field, and the KV bytes
per token the plan charges is compared with the served engine's own KV layout, so a default resolved
differently on either side (max_model_len, dtype auto, the batch budget, block size, KV dtype) fails here.
"""

from __future__ import annotations

import argparse
import json

import pytest
from kvserve_testing import TEST_MODEL_CONFIGS

from kvserve.cli import plan as plan_cli
from kvserve.cli import serve as serve_cli
from kvserve.cli.main import main
from kvserve.runtime import capacity
from kvserve.runtime.config import build_engine_config
from kvserve.runtime.engine_args import EngineArgs
from kvserve.runtime.errors import InvalidParameter
from kvserve.runtime.models.synthetic import make_shape_dir

# Each plan setting -> where the served engine's config holds it.
SERVED = {
    "dtype": lambda c: c.model.weight_dtype,
    "max_model_len": lambda c: c.scheduler.max_model_len,
    "max_num_batched_tokens": lambda c: c.scheduler.max_num_batched_tokens,
    "max_num_seqs": lambda c: c.scheduler.max_num_seqs,
    "block_size": lambda c: c.cache.block_size,
    "kv_cache_dtype": lambda c: c.cache.kv_cache_dtype,
    "enable_chunked_prefill": lambda c: c.scheduler.enable_chunked_prefill,
    "tensor_parallel_size": lambda c: c.tensor_parallel_size,
    "gpu_memory_utilization": lambda c: c.cache.gpu_memory_utilization,
}


def _model_dir(tmp_path, key: str, dtype: str, **overrides) -> str:
    arch, kwargs = TEST_MODEL_CONFIGS[key]
    kwargs = {k: v for k, v in kwargs.items() if k != "norm_weight_std"}  # a weights option, not config
    return make_shape_dir(str(tmp_path / key), arch, dtype=dtype, **{**kwargs, **overrides})


def _served(model_dir: str, flags: list[str]):
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    args = parser.parse_args([model_dir, *flags])
    return build_engine_config(EngineArgs.from_cli_args(args.model_dir, args))


def _planned(model_dir: str, flags: list[str], capsys) -> tuple[int, dict | str]:
    rc = main(["plan", "--model-config", model_dir, "--gpu", "a100-80gb", "-o", "json", *flags])
    out = capsys.readouterr().out
    return rc, (json.loads(out) if rc in (0, 1) else out)


def test_every_plan_setting_is_compared():
    assert set(SERVED) == set(plan_cli.PLAN_SETTINGS)


CASES = [
    # (model config, dtype written in config.json, config overrides, flags given to both commands)
    ("llama_gqa", "float32", {}, []),  # fp32 weights: plan must not assume bf16
    ("llama_gqa", "bfloat16", {"max_position_embeddings": 4096}, []),
    ("qwen2_qkv_bias", "float16", {"use_sliding_window": False, "sliding_window": 64}, []),  # flag off: no cap
    ("mistral", "bfloat16", {"max_position_embeddings": 8192, "sliding_window": 512}, []),  # capped at the window
    ("gemma2_sliding", "bfloat16", {}, []),  # Gemma implements its window: not capped
    ("qwen3_moe", "bfloat16", {}, []),
    ("llama_gqa", "float32", {}, ["--no-enable-chunked-prefill"]),  # batch budget = max_model_len
    ("llama_gqa", "bfloat16", {}, ["--kv-cache-dtype", "fp8"]),
    ("llama_gqa", "bfloat16", {}, ["--dtype", "fp8", "--kv-cache-dtype", "fp8_e5m2"]),
    ("llama_gqa", "float32", {}, ["--dtype", "bf16"]),  # an alias resolves to the same canonical dtype
    (
        "llama_gqa",
        "float32",
        {},
        [
            "--max-model-len",
            "512",
            "--block-size",
            "32",
            "--max-num-seqs",
            "64",
            "--max-num-batched-tokens",
            "1024",
            "-tp",
            "2",
            "--gpu-memory-utilization",
            "0.8",
        ],
    ),
]


@pytest.mark.parametrize(
    "key,dtype,overrides,flags", CASES, ids=[f"{c[0]}-{c[1]}-{'_'.join(c[3]) or 'defaults'}" for c in CASES]
)
def test_plan_and_serve_agree_on_every_setting(tmp_path, capsys, key, dtype, overrides, flags):
    model_dir = _model_dir(tmp_path, key, dtype, **overrides)
    served = _served(model_dir, flags)
    rc, plan = _planned(model_dir, flags, capsys)
    assert rc == 0, plan
    assert plan["engine"] == {name: get(served) for name, get in SERVED.items()}
    assert plan["max_model_len"] == served.model.max_model_len and plan["block_size"] == served.cache.block_size
    layout = served.model.kv_layout(served.cache.kv_cache_dtype, served.cache.block_size, served.tensor_parallel_size)
    assert plan["kv_bytes_per_token"] == layout.bytes_per_token
    assert plan["kv_bytes_per_token_per_gpu"] == layout.bytes_per_token_per_rank
    assert plan["weight_bytes"] == capacity.weight_bytes_per_rank(served.model.shape, served.model.weight_dtype, 1)


def test_the_defaults_are_the_models_own(tmp_path, capsys):
    """The numbers issue 22 found wrong in the plan: 8192 context, 8192 batched tokens, bf16 for fp32."""
    model_dir = _model_dir(tmp_path, "llama_gqa", "float32")
    rc, plan = _planned(model_dir, [], capsys)
    assert rc == 0
    assert (plan["engine"]["max_model_len"], plan["engine"]["max_num_batched_tokens"], plan["engine"]["dtype"]) == (
        1024,
        2048,
        "float32",
    )
    assert plan["kv_bytes_per_token"] == 2 * 2 * 2 * 8 * 4  # K+V x 2 layers x 2 KV heads x head_dim 8 x fp32


@pytest.mark.parametrize(
    "key,overrides,expected",
    [
        ("mistral", {"max_position_embeddings": 8192, "sliding_window": 512}, 512),  # kept inside the window
        ("gemma2_sliding", {}, 1024),  # sliding-window layers implemented: the full 1024 positions
        ("qwen2_qkv_bias", {"use_sliding_window": False, "sliding_window": 64}, 1024),
    ],
)
def test_the_context_default_follows_the_sliding_window_rule(tmp_path, capsys, key, overrides, expected):
    model_dir = _model_dir(tmp_path, key, "bfloat16", **overrides)
    rc, plan = _planned(model_dir, [], capsys)
    assert rc == 0 and plan["engine"]["max_model_len"] == expected == _served(model_dir, []).model.max_model_len


@pytest.mark.parametrize(
    "flags,field",
    [
        (["--max-model-len", "5000"], "max_model_len"),  # beyond the model's 1024 positions
        (["--no-enable-chunked-prefill", "--max-num-batched-tokens", "512"], "max_num_batched_tokens"),
        (["--dtype", "int4"], "dtype"),
    ],
)
def test_plan_refuses_what_serve_refuses_with_the_same_message(tmp_path, capsys, flags, field):
    model_dir = _model_dir(tmp_path, "llama_gqa", "float32")
    with pytest.raises(InvalidParameter) as info:
        _served(model_dir, flags)
    assert info.value.param == field
    rc, out = _planned(model_dir, flags, capsys)
    assert rc == 2 and out.strip() == f"error: {field}: {info.value}"


def test_plan_refuses_a_config_serve_refuses(tmp_path, capsys):
    model_dir = _model_dir(tmp_path, "llama_gqa", "float32", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(InvalidParameter, match="rope_type 'dynamic'") as info:
        _served(model_dir, [])
    assert info.value.param == "model"
    rc, out = _planned(model_dir, [], capsys)
    assert rc == 2 and "rope_type 'dynamic'" in out and out.startswith("error: model:")


def test_plan_flags_are_serves(tmp_path):
    """Same flag, type, default, choices and help for every setting `kvserve plan` takes."""

    def actions(add):
        parser = argparse.ArgumentParser()
        add(parser)
        return {a.dest: a for a in parser._actions}

    serve, plan = actions(serve_cli.add_arguments), actions(plan_cli.add_arguments)
    for name in plan_cli.PLAN_SETTINGS:
        s, p = serve[name], plan[name]
        assert (p.option_strings, p.type, p.default, p.choices, p.help) == (
            s.option_strings,
            s.type,
            s.default,
            s.choices,
            s.help,
        ), name


def test_engine_args_know_which_settings_were_given():
    # `kvserve plan --slo-*` searches the engine settings the user did not write: a written one (even with the
    # default's value) is told apart from a default.
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser, only=plan_cli.PLAN_SETTINGS)
    args = parser.parse_args(["--max-num-seqs", "256", "--block-size=32"])
    assert EngineArgs.explicit(args) == {"max_num_seqs", "block_size"}
    assert args.max_num_seqs == 256 and args.block_size == 32 and args.max_num_batched_tokens is None
    assert EngineArgs.explicit(parser.parse_args([])) == frozenset()

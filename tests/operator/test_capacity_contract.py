"""The capacity plan is a contract: every plan the operator accepts is one the runtime serves with exactly the
planned KV capacity, and what the planner refuses the runtime refuses too, for the same reason.

For every catalog model x GPU x tensor-parallel size x KV dtype x weights dtype, the InferenceService is
resolved and rendered as the operator would, the model's config.json is written from the catalog shape (no
weights), and the rendered pod args go through the runtime's own flag parsing (`kvserve serve`), config
validation (EngineArgs -> EngineConfig) and KV sizing (worker/kv_sizing.py, what ModelRunner runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from kvserve.cli import serve
from kvserve.operator import render
from kvserve.operator import spec as spec_mod
from kvserve.runtime import capacity
from kvserve.runtime.config import build_engine_config
from kvserve.runtime.engine_args import EngineArgs
from kvserve.runtime.errors import InvalidParameter
from kvserve.runtime.executor import kv_sizing
from kvserve.runtime.executor.pipeline import stage_engine_config
from kvserve.runtime.planner import catalog, kv_plan

MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
}
DTYPES = ("bfloat16", "float16", "fp8")
KV_DTYPES = ("auto", "fp8")


def hf_config(shape: capacity.ModelShape) -> dict:
    """The config.json a checkpoint of this shape carries (the fields the runtime reads)."""
    cfg = {
        "architectures": [shape.architecture],
        "model_type": MODEL_TYPES[shape.architecture],
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
        "attention_bias": shape.attention_bias and shape.architecture != "Qwen2ForCausalLM",
    }
    if shape.architecture == "MistralForCausalLM":
        cfg["sliding_window"] = None  # v0.2/v0.3 (the catalog's shape); transformers' default would be 4096
    if shape.sliding_window:  # Gemma: which layers slide comes from transformers' rule for the model type
        cfg.update(sliding_window=shape.sliding_window, query_pre_attn_scalar=shape.head_dim)
    if shape.num_experts:
        cfg.update(
            num_local_experts=shape.num_experts,
            num_experts=shape.num_experts,
            num_experts_per_tok=shape.experts_per_token,
            moe_intermediate_size=shape.intermediate_size,
        )
    return cfg


@pytest.fixture(scope="module", autouse=True)
def cached_config_reads():
    """~2,700 combinations re-read 14 config.json files: cache transformers' parse of each (the runtime's
    validation still runs on every combination)."""
    import functools

    import transformers

    original = transformers.AutoConfig.from_pretrained
    cached = functools.lru_cache(maxsize=None)(
        lambda path, local_files_only: original(path, local_files_only=local_files_only)
    )
    transformers.AutoConfig.from_pretrained = lambda path, local_files_only=False: cached(path, local_files_only)
    yield
    transformers.AutoConfig.from_pretrained = original


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("catalog-configs")
    dirs = {}
    for key, shape in catalog.MODELS.items():
        d = root / key
        d.mkdir()
        (d / "config.json").write_text(json.dumps(hf_config(shape)))
        dirs[key] = str(d)
    return dirs


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve serve", exit_on_error=False)
    serve.add_arguments(parser)
    return parser


PARSER = _serve_parser()


def runtime_config_from_pod(command: list[str], model_dir: str):
    """What `kvserve serve` does with the pod's command line, up to (not including) loading weights."""
    assert command[:2] == ["kvserve", "serve"]
    args = PARSER.parse_args(command[2:])  # unknown flags fail: the pod would crash-loop on them
    return build_engine_config(EngineArgs.from_cli_args(model_dir, args))


def _spec(key: str, gpu: str, t: int, kv: str, dtype: str) -> dict:
    max_len = min(8192, catalog.MODELS[key].max_position_embeddings)
    return {
        "model": {"name": key, "uri": "file:///models/x", "dtype": dtype},
        "gpu": {"product": gpu, "tensorParallelSize": t},
        "engine": {"kvCacheDtype": kv, "maxModelLen": max_len},
    }


COMBOS = [
    (key, gpu, t, kv, dtype)
    for key in sorted(catalog.MODELS)
    for gpu in sorted(catalog.GPUS)
    for t in (1, 2, 4, 8)
    for kv in KV_DTYPES
    for dtype in DTYPES
]


def _engine_command(objs: list[dict]) -> list[str]:
    """The engine pod's command: the Deployment's, or a LeaderWorkerSet leader's (node rank 0)."""
    for obj in objs:
        if obj["kind"] == "Deployment":
            return obj["spec"]["template"]["spec"]["containers"][0]["command"]
        if obj["kind"] == "LeaderWorkerSet":
            return obj["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]["command"]
    raise AssertionError(f"no engine workload in {[o['kind'] for o in objs]}")


@pytest.mark.parametrize("key", sorted(catalog.MODELS))
def test_every_accepted_plan_is_served_with_exactly_the_planned_capacity(key, model_dirs):
    accepted = refused = 0
    for _, gpu, t, kv, dtype in (c for c in COMBOS if c[0] == key):
        resolved = spec_mod.resolve(_spec(key, gpu, t, kv, dtype))
        plan = resolved.plan
        if plan.reason in ("UnsupportedArchitecture", "InvalidTensorParallelSize"):
            # The runtime refuses these too (at load / before starting workers), with its own list.
            refused += 1
            with pytest.raises(InvalidParameter):
                config = runtime_config_from_pod(
                    ["kvserve", "serve", model_dirs[key], "-tp", str(t), "--dtype", dtype], model_dirs[key]
                )
                error = capacity.tp_shape_error(
                    config.model.num_heads, config.model.num_kv_heads, config.model.shape.intermediate_size, t
                )
                if error:
                    raise InvalidParameter("tensor_parallel_size", error)
            continue
        if not plan.fits:
            refused += 1
            continue
        accepted += 1
        objs = render.render(resolved, "x", "default")
        config = runtime_config_from_pod(_engine_command(objs), model_dirs[key])
        if config.pipeline_parallel_size > 1:
            # A replica larger than one node (a LeaderWorkerSet of PP stages): every stage sizes the same
            # --kv-cache-bytes for its own layers and the executor takes the minimum; that stage is checked,
            # and the planner charged the heaviest stage's weights.
            ranges = config.parallel.stage_layers
            weights = max(
                capacity.stage_weight_bytes_per_rank(
                    config.model.shape, config.model.weight_dtype, t, r, i == 0, i == len(ranges) - 1
                )
                for i, r in enumerate(ranges)
            )
            stage_configs = [stage_engine_config(config, r) for r in ranges]
            blocks = [kv_sizing.explicit_num_blocks(c) for c in stage_configs]
            config = stage_configs[blocks.index(min(blocks))]
        else:
            weights = capacity.weight_bytes_per_rank(config.model.shape, config.model.weight_dtype, t)
        num_blocks = kv_sizing.explicit_num_blocks(config)
        kv_sizing.check_one_sequence_fits(config, num_blocks)  # the runtime's startup check passes
        where = (key, gpu, t, kv, dtype)
        assert num_blocks == plan.num_blocks_per_gpu, where
        assert kv_sizing.layout(config).usable_tokens(num_blocks) == plan.kv_tokens, where
        assert (
            kv_sizing.layout(config).max_concurrency(
                num_blocks, config.model.max_model_len, config.scheduler.max_num_batched_tokens
            )
            == plan.max_concurrency
        ), where
        assert kv_sizing.layout(config).bytes_per_token_per_rank == plan.kv_bytes_per_token_per_gpu, where
        # The weights the runtime allocates per rank (from config.json) are what the planner charged.
        assert weights == plan.weight_bytes_per_gpu, where
        assert (
            capacity.tp_shape_error(
                config.model.num_heads, config.model.num_kv_heads, config.model.shape.intermediate_size, t
            )
            is None
        )
    assert accepted + refused > 0


@pytest.mark.parametrize(
    "key,t,kv,dtype",
    [
        ("llama-3-8b", 1, "auto", "bfloat16"),
        ("llama-3-70b", 4, "fp8", "fp8"),
        ("qwen2.5-7b", 4, "auto", "float16"),
        ("llama-2-7b", 2, "fp8", "bfloat16"),
    ],
)
def test_one_block_short_is_refused_by_both_with_the_same_reason(key, t, kv, dtype, model_dirs):
    m = catalog.MODELS[key]
    max_len = 4096
    layout = capacity.kv_layout(m, dtype, kv, 16, t)
    exact_blocks = capacity.blocks_per_sequence(max_len, 16) + capacity.NULL_BLOCKS  # one sequence + null block
    weights = capacity.weight_bytes_per_rank(m, dtype, t)
    overhead_mib = 64
    fixed = weights + overhead_mib * catalog.MiB

    def plan_for(num_blocks: int) -> kv_plan.Plan:
        return kv_plan.plan(
            kv_plan.PlanInput(
                model=m,
                gpu_memory_bytes=fixed + layout.budget_for_blocks(num_blocks),
                tensor_parallel_size=t,
                dtype=dtype,
                kv_cache_dtype=kv,
                max_model_len=max_len,
                gpu_memory_utilization=1.0,
                activation_reserve_bytes=0,
                runtime_overhead_bytes=overhead_mib * catalog.MiB,
            )
        )

    exact = plan_for(exact_blocks)
    assert exact.fits and exact.max_concurrency == 1 and exact.kv_tokens == max_len
    short = plan_for(exact_blocks - 1)
    assert not short.fits and short.reason == "ContextDoesNotFit"

    base = [
        "kvserve",
        "serve",
        model_dirs[key],
        "--dtype",
        dtype,
        "-tp",
        str(t),
        "--kv-cache-dtype",
        kv,
        "--max-model-len",
        str(max_len),
    ]
    ok = runtime_config_from_pod(base + ["--kv-cache-bytes", str(exact.kv_cache_bytes_per_gpu)], model_dirs[key])
    kv_sizing.check_one_sequence_fits(ok, kv_sizing.explicit_num_blocks(ok))
    bad = runtime_config_from_pod(
        base + ["--kv-cache-bytes", str(layout.budget_for_blocks(exact_blocks - 1))], model_dirs[key]
    )
    with pytest.raises(kv_sizing.PlanRejected) as err:
        kv_sizing.check_one_sequence_fits(bad, kv_sizing.explicit_num_blocks(bad))
    assert str(err.value) == short.message  # the same sentence on both sides


def test_the_null_block_is_not_planned_as_capacity():
    # The example: llama-3-70b on 4x A100-80GB used to promise every block (29,863 x 16 = 477,808).
    r = spec_mod.resolve(
        {"model": {"name": "llama-3-70b", "uri": "file:///m"}, "gpu": {"product": "a100-80gb", "tensorParallelSize": 4}}
    )
    assert r.plan.kv_tokens == (r.plan.num_blocks_per_gpu - 1) * 16


def test_engine_args_and_crd_agree():
    from kvserve.runtime import engine_args

    for path, default in engine_args.crd_defaults().items():
        section, key = path.split(".")
        assert spec_mod.DEFAULTS[section][key] == default
    # Every engine setting the CRD exposes renders as a flag the runtime parses back to the same value.
    resolved = spec_mod.resolve(
        {
            "model": {"name": "llama-3-8b", "uri": "file:///m"},
            "gpu": {"product": "h100"},
            "engine": {"maxModelLen": 4096, "enablePrefixCaching": False},
        }
    )
    args = PARSER.parse_args(render.runtime_args(resolved, "x", "/m")[2:])
    for path, name in engine_args.crd_settings().items():
        assert getattr(args, name) == resolved.spec.value_at(path), path


def test_runtime_weight_bytes_match_the_planner(tmp_path):
    """What the runtime's model really allocates per rank (built on the meta device, so no memory), against
    capacity.weight_bytes_per_rank: dense, GQA replicated past the KV heads, biases, tied embeddings."""
    import torch

    from kvserve.runtime.config import load_model_config
    from kvserve.runtime.models import fp8
    from kvserve.runtime.models.parallel_layers import ColumnParallelLinear, ParallelContext, RowParallelLinear
    from kvserve.runtime.models.registry import model_class

    shapes = {
        "llama": capacity.ModelShape(2, 8, 2, 16, 128, 0, 512, 344, 1001),
        "qwen2-tied": capacity.ModelShape(
            2,
            4,
            4,
            32,
            128,
            0,
            512,
            256,
            1000,
            architecture="Qwen2ForCausalLM",
            attention_bias=True,
            tie_word_embeddings=True,
        ),
        "llama-bias": capacity.ModelShape(2, 4, 1, 32, 128, 0, 512, 256, 999, attention_bias=True, o_proj_bias=True),
        # four norms per layer, tied; Gemma 3 adds q/k norms (model_type rule: layers 0, 2 slide / 0..4 of 6)
        "gemma2": capacity.ModelShape(4, 4, 2, 32, 128, 0, 512, 256, 1000, **catalog._GEMMA2, num_sliding_layers=2),
        "gemma3": capacity.ModelShape(
            6, 4, 1, 64, 128, 0, 512, 256, 1000, **{**catalog._GEMMA3, "sliding_window": 64}, num_sliding_layers=5
        ),
    }
    for name, shape in shapes.items():
        d = tmp_path / name
        d.mkdir()
        cfg = hf_config(shape)
        (d / "config.json").write_text(json.dumps(cfg))
        config = load_model_config(str(d), "float32")
        assert dataclasses.replace(config.shape, num_parameters=0) == dataclasses.replace(shape, num_parameters=0), name
        for t in capacity.valid_tp_sizes(shape.num_attention_heads, shape.num_kv_heads, shape.intermediate_size, 4):
            for rank in range(t):
                with torch.device("meta"):
                    model = model_class(shape.architecture)(config, None, ParallelContext(rank=rank, size=t))
                allocated = sum(p.numel() * 4 for p in model.parameters())
                assert allocated == capacity.weight_bytes_per_rank(shape, "float32", t), (name, t, rank)
                # --dtype fp8: the loader's conversion, on the same meta model (16-bit rest, 1-byte linears)
                with torch.device("meta"):
                    model = model.to(torch.bfloat16)
                    fp8.convert_linears(model.layers, (ColumnParallelLinear, RowParallelLinear))
                allocated = sum(
                    x.numel() * x.element_size()
                    for x in (*model.parameters(), *model.buffers())
                    if x is not getattr(model.rotary, "cos", None) and x is not getattr(model.rotary, "sin", None)
                )
                assert allocated == capacity.weight_bytes_per_rank(shape, "fp8", t), (name, t, rank, "fp8")

"""vLLM command lines run unchanged (issue 39, scope 5): `vllm serve` lines in the forms vLLM's documentation
writes them, with `vllm` replaced by `kvserve`, parse to the engine settings they mean; --lora-modules in
vLLM's space-separated name=path and JSON forms (and kvserve's comma form, which the operator renders).

Each row: the command line's flags after the model, then the EngineArgs / serve fields it must set."""

from __future__ import annotations

import shlex

import pytest

from kvserve.cli.main import build_parser
from kvserve.runtime.config import parse_lora_modules
from kvserve.runtime.engine_args import EngineArgs
from kvserve.runtime.errors import InvalidParameter

LORA_JSON = '{"name": "sql-lora", "path": "/loras/sql", "base_model_name": "meta-llama/Llama-2-7b-hf"}'
TABLE = [
    # docs/features/lora: static adapters at start-up
    (
        "--enable-lora --lora-modules sql-lora=/loras/sql chat-lora=/loras/chat",
        dict(enable_lora=True, lora=(("sql-lora", "/loras/sql"), ("chat-lora", "/loras/chat"))),
    ),
    (f"--enable-lora --lora-modules '{LORA_JSON}'", dict(enable_lora=True, lora=(("sql-lora", "/loras/sql"),))),
    (
        f"--enable-lora --lora-modules '{LORA_JSON}' other=/loras/other --max-lora-rank 64 --max-loras 2",
        dict(lora=(("sql-lora", "/loras/sql"), ("other", "/loras/other")), max_lora_rank=64, max_loras=2),
    ),
    ("--enable-lora --lora-modules a=/x,b=/y", dict(lora=(("a", "/x"), ("b", "/y")))),  # the operator's form
    # docs/serving/distributed_serving
    ("--tensor-parallel-size 2", dict(tensor_parallel_size=2)),
    ("-tp 2", dict(tensor_parallel_size=2)),
    ("-tp 2 -pp 2", dict(tensor_parallel_size=2, pipeline_parallel_size=2)),
    # docs/serving/openai_compatible_server
    ("--served-model-name gpt-4o my-model", dict(served_model_name=["gpt-4o", "my-model"])),
    ("--dtype half --api-key token-abc123", dict(dtype="half", api_key="token-abc123")),
    ("--dtype bfloat16 --max-model-len 4096 --seed 42", dict(dtype="bfloat16", max_model_len=4096, seed=42)),
    ("--gpu-memory-utilization 0.85 --max-num-seqs 128", dict(gpu_memory_utilization=0.85, max_num_seqs=128)),
    ("--no-enable-prefix-caching --block-size 32", dict(enable_prefix_caching=False, block_size=32)),
    ("--max-num-batched-tokens 8192 --enable-chunked-prefill", dict(max_num_batched_tokens=8192)),
    ("--kv-cache-dtype fp8", dict(kv_cache_dtype="fp8")),
    # docs/features/spec_decode
    (
        '--speculative-config \'{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}\'',
        dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}'),
    ),
    ("--tool-call-parser hermes --host 127.0.0.1 --port 8001", dict(tool_call_parser="hermes", port=8001)),
]


@pytest.mark.parametrize("flags,expected", TABLE, ids=[row[0][:60] for row in TABLE])
def test_vllm_command_line_parses(flags, expected):
    ns = build_parser().parse_args(["serve", "/models/m", *shlex.split(flags)])
    args = EngineArgs.from_cli_args(ns.model_dir, ns)
    for name, value in expected.items():
        if name == "lora":
            assert parse_lora_modules(args.lora_modules) == value
        else:
            got = getattr(args, name) if hasattr(args, name) else getattr(ns, name)
            assert got == value, name


@pytest.mark.parametrize(
    "value,message",
    [
        (["sql-lora"], "distinct name=path pairs"),
        (["a=/x", "a=/y"], "distinct name=path pairs"),
        (['{"name": "a"}'], 'needs "name" and "path"'),
        (['{"name": "a", "path": "/x", "rank": 8}'], 'needs "name" and "path"'),
        (["{not json"], "is not valid JSON"),
    ],
)
def test_bad_lora_modules_name_the_field(value, message):
    with pytest.raises(InvalidParameter, match=message) as e:
        parse_lora_modules(value)
    assert e.value.param == "lora_modules"


def test_llm_kwargs_take_the_same_forms():
    assert parse_lora_modules({"a": "/x"}) == (("a", "/x"),)
    assert parse_lora_modules([{"name": "a", "path": "/x"}, "b=/y"]) == (("a", "/x"), ("b", "/y"))

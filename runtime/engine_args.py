"""Every engine setting, defined once (vLLM's EngineArgs idea).

From this one dataclass:
- `kvserve serve` builds its engine flags (`add_cli_args`, `from_cli_args`);
- `LLM(model, **kwargs)` and `LLMEngine.from_kwargs` take their keyword arguments (`from_kwargs`);
- the operator renders the pod's runtime args (`cli_args`) and its spec defaults (`crd_defaults`), and a
  test checks the CRD's defaults against it (tests/operator/test_crd.py).
Validation lives in `runtime.config.make_engine_config`, which receives exactly these fields.

Stdlib only (no torch, no runtime imports at module level): the operator imports this module and
kvserve.runtime.capacity, nothing else of the runtime (tests/test_layering.py).
"""
from __future__ import annotations

import argparse
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """`1073741824`, `512MiB`, `1G`, `1.5GB` -> bytes (binary multiples: a KV budget is a memory size)."""
    match = _SIZE.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (examples: 536870912, 512MiB, 2G)")
    value, unit = float(match.group(1)), match.group(2).lower()
    return int(value * 1024 ** ("kmgt".find(unit) + 1)) if unit else int(value)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_int_list(text: str) -> list[int]:
    """"1,2, 4" -> [1, 2, 4] (order kept); ValueError unless every comma-separated part is an integer >= 1."""
    try:
        values = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"expected comma-separated positive integers, e.g. 1,2,4; got {text!r}")
    return values


def _setting(default: Any, help: str, *, type: Any = None, choices: tuple | None = None, crd: str | None = None,
             crd_default: Any = MISSING, hidden: bool = False, flag: str | None = None,
             aliases: tuple[str, ...] = ()) -> Any:
    """A field with its CLI and CRD metadata. crd: the InferenceService spec path ("engine.maxModelLen");
    crd_default: the operator's default where the engine's depends on the model or device (the planner
    needs a number, e.g. max_model_len)."""
    meta = dict(help=help, type=type, choices=choices, crd=crd, crd_default=crd_default, hidden=hidden, flag=flag,
                aliases=aliases)
    return field(default=default, metadata=meta)


@dataclass
class EngineArgs:
    model: str = _setting(None, "HF-format model directory", hidden=True)
    dtype: str = _setting(
        "auto", "weights dtype: auto (from config.json), float32, bfloat16, float16, or fp8 (online FP8 weight "
                "quantisation at load: 1 byte per linear weight, bfloat16 activations)", crd="model.dtype",
        crd_default="bfloat16")
    max_model_len: int | None = _setting(
        None, "context length (default: the model's max_position_embeddings)", type=positive_int,
        crd="engine.maxModelLen", crd_default=8192)
    block_size: int = _setting(16, "tokens per KV-cache block", type=positive_int, crd="engine.blockSize")
    max_num_seqs: int = _setting(256, "max sequences per step", type=positive_int, crd="engine.maxNumSeqs")
    max_num_batched_tokens: int | None = _setting(
        None, "token budget per step (default: 2048 with chunked prefill, else max_model_len)", type=positive_int,
        crd="engine.maxNumBatchedTokens", crd_default=8192)
    enable_prefix_caching: bool = _setting(True, "automatic prefix caching", crd="engine.enablePrefixCaching")
    enable_chunked_prefill: bool = _setting(True, "split long prompts across steps",
                                            crd="engine.enableChunkedPrefill")
    long_prefill_token_threshold: int = _setting(
        0, "with chunked prefill: at most this many prompt tokens of one request per step (0: only the step "
           "budget limits it); keeps decode steps short among long prompts", type=int)
    kv_cache_bytes: int | None = _setting(
        None, "KV-cache budget per tensor-parallel rank, e.g. 512MiB (CPU default: 1GiB; GPUs profile the "
              "forward when it is not given, and verify it fits when it is)", type=parse_bytes)
    num_kv_blocks: int | None = _setting(None, "explicit KV block count (tests)", type=positive_int, hidden=True)
    gpu_memory_utilization: float = _setting(0.9, "fraction of GPU memory for weights, activations and KV",
                                             type=float, crd="engine.gpuMemoryUtilization")
    kv_cache_dtype: str = _setting(
        "auto", "KV cache element type; fp8 (= fp8_e4m3) halves KV bytes per token vs 16-bit (per-tensor scale 1.0)",
        choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"), crd="engine.kvCacheDtype")
    seed: int = _setting(0, "random seed for sampling without a per-request seed", type=int)
    preemption_mode: str = _setting(
        "recompute", "when the KV cache is full: drop the victim's KV and recompute, or swap it to host RAM",
        choices=("recompute", "swap"))
    swap_space_bytes: int | None = _setting(
        None, "host RAM for --preemption-mode swap, in bytes (suffixes like 4GiB accepted; default 4GiB)",
        type=parse_bytes, flag="--swap-space")
    attention_backend: str | None = _setting(
        None, "torch, triton or cpu (default: triton on CUDA; on CPU the compiled 'cpu' ops when they build, "
              "else torch); torch forces the pure-torch path", choices=("torch", "triton", "cpu"))
    tensor_parallel_size: int = _setting(
        1, "shard the model over this many worker processes / GPUs (NCCL on CUDA, gloo on CPU); KV budgets are "
           "per rank", type=positive_int, crd="gpu.tensorParallelSize", aliases=("-tp",))
    device: str | None = _setting(None, "cpu or cuda (default: cuda when available)", hidden=True)
    max_consecutive_step_failures: int = _setting(
        3, "declare the engine dead (/health 503, every request answered, the server exits 1) after this many "
           "engine steps in a row fail", type=positive_int)

    load_format: str = _setting(
        "auto", "auto: read the model directory's safetensors; dummy: random weights made on the device from "
                "config.json alone (benchmarks of a model shape without its checkpoint, as vLLM's dummy format)",
        choices=("auto", "dummy"))
    cuda_graphs: bool = _setting(
        False, "capture pure-decode steps as CUDA graphs at start-up (batch sizes --cuda-graph-sizes) and replay "
               "them: one launch per decode step instead of hundreds. Needs CUDA, the triton attention backend, "
               "tensor_parallel_size 1, a model with one KV cache group and no MoE layers")
    cuda_graph_sizes: str | None = _setting(
        None, "with --cuda-graphs: comma-separated decode batch sizes to capture, e.g. 1,2,4,8,16,32,64 (default: "
              "1, 2, 4 and every multiple of 8 up to min(max_num_seqs, 512)); a decode step pads to the next "
              "size, larger ones run eagerly", type=str)

    api_server_count: int = _setting(
        1, "`kvserve serve` only: run this many API-server processes (HTTP, tokenisation, detokenisation, "
           "JSON/SSE) on the same host:port (SO_REUSEPORT) in front of one engine core, for tokenisation-heavy "
           "traffic; /metrics on any of them shows the group's sums. 1 (default): one server process",
        type=positive_int)

    # -- construction ----------------------------------------------------------------------------------
    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineArgs":
        """Raises UnknownEngineArgument (a TypeError naming the argument) for a kwarg that is no setting."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise UnknownEngineArgument(unknown[0], f"unknown engine argument {unknown[0]!r}; known: "
                                                    f"{', '.join(sorted(known - {'model'}))}")
        return cls(model=model, **kwargs)

    # -- command line ----------------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in fields(cls):
            if f.name == "model":
                continue
            meta = f.metadata
            flag = meta["flag"] or cli_flag(f.name)
            help_text = argparse.SUPPRESS if meta["hidden"] else meta["help"]
            if isinstance(f.default, bool):
                parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                                    help=f"{help_text} (default: {'on' if f.default else 'off'})"
                                    if not meta["hidden"] else help_text)
                continue
            kwargs: dict[str, Any] = dict(dest=f.name, default=f.default, help=help_text)
            if meta["type"] is not None:
                kwargs["type"] = meta["type"]
            if meta["choices"]:
                kwargs["choices"] = list(meta["choices"])
            parser.add_argument(flag, *meta["aliases"], **kwargs)

    @classmethod
    def from_cli_args(cls, model: str, namespace: argparse.Namespace) -> "EngineArgs":
        return cls(model=model, **{f.name: getattr(namespace, f.name) for f in fields(cls) if f.name != "model"})


class UnknownEngineArgument(TypeError):
    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


def cli_flag(name: str) -> str:
    meta = next(f.metadata for f in fields(EngineArgs) if f.name == name)
    return meta["flag"] or "--" + name.replace("_", "-")


def cli_args(values: dict[str, Any]) -> list[str]:
    """Engine settings -> `kvserve serve` flags (the operator's pod args), in definition order. Booleans
    render as --x / --no-x; None is omitted (the engine's default applies)."""
    by_name = {f.name: f for f in fields(EngineArgs)}
    unknown = sorted(set(values) - set(by_name))
    if unknown:
        raise KeyError(f"unknown engine setting(s): {', '.join(unknown)}")
    args: list[str] = []
    for name in by_name:
        if name not in values or name == "model" or values[name] is None:
            continue
        value, flag = values[name], cli_flag(name)
        if isinstance(by_name[name].default, bool):
            args.append(flag if value else "--no-" + flag[2:])
        else:
            args += [flag, str(value)]
    return args


def crd_settings() -> dict[str, str]:
    """Spec path ("engine.maxModelLen") -> engine setting name, for every setting the CRD exposes."""
    return {f.metadata["crd"]: f.name for f in fields(EngineArgs) if f.metadata["crd"]}


def crd_defaults() -> dict[str, Any]:
    """Spec path -> the default the operator applies (the engine's own unless a crd_default is given)."""
    out = {}
    for f in fields(EngineArgs):
        if f.metadata["crd"]:
            crd_default = f.metadata["crd_default"]
            out[f.metadata["crd"]] = f.default if crd_default is MISSING else crd_default
    return out

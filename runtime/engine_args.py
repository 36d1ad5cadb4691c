"""Every engine setting, defined once (vLLM's EngineArgs idea).

From this one dataclass:
- `kvserve serve` builds its engine flags (`add_cli_args`, `from_cli_args`);
- `LLM(model, **kwargs)` and `LLMEngine.from_kwargs` take their keyword arguments (`from_kwargs`);
- `kvserve plan` builds its engine flags from the same fields (`add_cli_args(parser, only=...)`);
- the operator renders the pod's runtime args (`cli_args`), its spec defaults (`crd_defaults`) and its spec's
  enums (`crd_choices`), and tests check the CRD's defaults and enums against them (tests/operator/test_crd.py).

`resolve` turns the model-dependent defaults (max_model_len, dtype "auto", max_num_batched_tokens) into the
numbers `kvserve serve` runs with, from the model's config.json or a catalog shape: runtime.config's
build_engine_config calls it for serve / LLM, and `kvserve plan` calls it, so a plan describes the server that
starts. The rest of the validation lives in `runtime.config.build_engine_config`.

Torch-free (stdlib, runtime.capacity and runtime.errors): the operator imports this module and
kvserve.runtime.capacity, nothing else of the runtime (tests/test_layering.py).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from kvserve.runtime import capacity
from kvserve.runtime.errors import InvalidParameter

# KV-cache block sizes the runtime (and the triton kernels, which gather any block size) accept.
BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
# max_num_batched_tokens when it is not given and chunked prefill is on (without it: max_model_len).
CHUNKED_PREFILL_BATCHED_TOKENS = 2048
# What the engine does with a victim's KV when the cache is full (--preemption-mode).
PREEMPTION_MODES = ("recompute", "swap")
# Host RAM for swapped-out KV when --preemption-mode swap is given without --swap-space (vLLM's default).
DEFAULT_SWAP_SPACE_BYTES = 4 << 30
# What the operator may put in a pod's spec for `--dtype`: every weight dtype but "auto", which the operator
# cannot plan before it has read config.json (catalog and pvc:// models never give it one).
CRD_DTYPES = tuple(d for d in capacity.WEIGHT_DTYPES if d != "auto")

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
    """ "1,2, 4" -> [1, 2, 4] (order kept); ValueError unless every comma-separated part is an integer >= 1."""
    try:
        values = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"expected comma-separated positive integers, e.g. 1,2,4; got {text!r}")
    return values


def kv_offloading_bytes(size_gib: float | None) -> int:
    """--kv-offloading-size (GiB, None = off) as bytes."""
    return int((size_gib or 0) * (1 << 30))


def _setting(
    default: Any,
    help: str,
    *,
    type: Any = None,
    choices: tuple | None = None,
    crd: str | None = None,
    crd_default: Any = MISSING,
    crd_choices: tuple | None = None,
    hidden: bool = False,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    nargs: str | None = None,
) -> Any:
    """A field with its CLI and CRD metadata. crd: the InferenceService spec path ("engine.maxModelLen");
    crd_default: the operator's default where the engine's depends on the model or device (the planner
    needs a number, e.g. max_model_len); crd_choices: the CRD enum where it is not `choices`."""
    meta = dict(
        help=help,
        type=type,
        choices=choices,
        crd=crd,
        crd_default=crd_default,
        crd_choices=crd_choices,
        hidden=hidden,
        flag=flag,
        aliases=aliases,
        nargs=nargs,
    )
    return field(default=default, metadata=meta)


EXPLICIT_ATTR = "_explicit_settings"


class _StoreExplicit(argparse.Action):
    """argparse's store that also notes the setting as given (EngineArgs.explicit)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, EXPLICIT_ATTR, {*getattr(namespace, EXPLICIT_ATTR, ()), self.dest})


@dataclass
class EngineArgs:
    model: str = _setting(None, "HF-format model directory, or a GGUF file (MODEL.gguf)", hidden=True)
    tokenizer: str | None = _setting(
        None,
        "for a GGUF model: a tokenizer directory to use instead of the one in the file's metadata",
        type=str,
    )
    dtype: str = _setting(
        "auto",
        f"weights dtype: {', '.join(capacity.WEIGHT_DTYPES)} (auto: the dtype config.json declares, float32 "
        f"if none; fp8: online FP8 weight quantisation at load, 1 byte per linear weight, "
        f"{capacity.FP8_ACTIVATION_DTYPE} activations)",
        crd="model.dtype",
        crd_default="bfloat16",
        crd_choices=CRD_DTYPES,
    )
    max_model_len: int | None = _setting(
        None,
        "context length (default: the model's max_position_embeddings)",
        type=positive_int,
        crd="engine.maxModelLen",
        crd_default=8192,
    )
    block_size: int = _setting(
        16, "tokens per KV-cache block", type=positive_int, choices=BLOCK_SIZES, crd="engine.blockSize"
    )
    max_num_seqs: int = _setting(256, "max sequences per step", type=positive_int, crd="engine.maxNumSeqs")
    max_num_batched_tokens: int | None = _setting(
        None,
        f"token budget per step (default: {CHUNKED_PREFILL_BATCHED_TOKENS} with chunked prefill, else max_model_len)",
        type=positive_int,
        crd="engine.maxNumBatchedTokens",
        crd_default=8192,
    )
    enable_prefix_caching: bool = _setting(True, "automatic prefix caching", crd="engine.enablePrefixCaching")
    enable_chunked_prefill: bool = _setting(True, "split long prompts across steps", crd="engine.enableChunkedPrefill")
    long_prefill_token_threshold: int = _setting(
        0,
        "with chunked prefill: at most this many prompt tokens of one request per step (0: only the step "
        "budget limits it); keeps decode steps short among long prompts",
        type=int,
    )
    kv_cache_bytes: int | None = _setting(
        None,
        "KV-cache budget per tensor-parallel rank, e.g. 512MiB (CPU default: 1GiB; GPUs profile the "
        "forward when it is not given, and verify it fits when it is)",
        type=parse_bytes,
    )
    num_kv_blocks: int | None = _setting(None, "explicit KV block count (tests)", type=positive_int, hidden=True)
    gpu_memory_utilization: float = _setting(
        0.9, "fraction of GPU memory for weights, activations and KV", type=float, crd="engine.gpuMemoryUtilization"
    )
    kv_cache_dtype: str = _setting(
        "auto",
        "KV cache element type; fp8 (= fp8_e4m3) halves KV bytes per token vs 16-bit (per-tensor scale 1.0)",
        choices=capacity.KV_CACHE_DTYPES,
        crd="engine.kvCacheDtype",
    )
    seed: int = _setting(0, "random seed for sampling without a per-request seed", type=int)
    structured_output_max_number_digits: int = _setting(
        9,
        "JSON-schema outputs: an integer/number without minimum/maximum may have at most this many integer "
        "digits, so a sampled number always ends",
        type=positive_int,
    )
    preemption_mode: str = _setting(
        "recompute",
        "when the KV cache is full: drop the victim's KV and recompute, or swap it to host RAM",
        choices=PREEMPTION_MODES,
    )
    swap_space_bytes: int | None = _setting(
        None,
        "host RAM for --preemption-mode swap, in bytes (suffixes like 4GiB accepted; default 4GiB)",
        type=parse_bytes,
        flag="--swap-space",
    )
    kv_offloading_size: float | None = _setting(
        None,
        "host KV tier in GiB, in total over the tensor/pipeline-parallel ranks (vLLM's flag): full prefix blocks "
        "are copied to host RAM as they are cached and loaded back on a prefix hit instead of recomputed; "
        "0 or unset: off",
        type=float,
    )
    kv_offloading_disk_dir: str | None = _setting(
        None,
        "a local disk KV tier below the host tier (needs --kv-offloading-size): one checksummed file "
        "per block and rank, written by a thread, reused by a later engine of the same model and KV layout",
    )
    kv_offloading_disk_size: float | None = _setting(
        None, "the disk KV tier's size in GiB (with --kv-offloading-disk-dir)", type=float
    )
    kv_offloading_remote_url: str | None = _setting(
        None,
        "a remote KV tier in an existing Redis / Valkey store, e.g. redis://127.0.0.1:6379/0 (LMCache's "
        "remote_url; needs --kv-offloading-size): blocks are written through by a thread, found by any engine "
        "of the same model and KV layout, and evicted by the store (maxmemory-policy allkeys-lru)",
    )
    attention_backend: str | None = _setting(
        None,
        "torch, triton or cpu (default: triton on CUDA; on CPU the compiled 'cpu' ops when they build, "
        "else torch); torch forces the pure-torch path",
        choices=("torch", "triton", "cpu"),
    )
    tensor_parallel_size: int = _setting(
        1,
        "shard the model over this many worker processes / GPUs (NCCL on CUDA, gloo on CPU); KV budgets are per rank",
        type=positive_int,
        crd="gpu.tensorParallelSize",
        aliases=("-tp",),
        crd_choices=(1, 2, 4, 8),
    )  # the operator: a pod's GPUs on one node
    pipeline_parallel_size: int = _setting(
        1,
        "split the decoder layers over this many pipeline stages, each of --tensor-parallel-size worker "
        "processes (world = TP x PP); activations pass between stages (docs/multinode.md)",
        type=positive_int,
        aliases=("-pp",),
    )
    pipeline_layer_split: str | None = _setting(
        None,
        "with --pipeline-parallel-size: comma-separated decoder-layer counts per stage, e.g. 31,32,32,31 "
        "(default: balanced by count, earlier stages taking the remainder; also $KVSERVE_PP_LAYER_PARTITION)",
        type=str,
    )
    nnodes: int = _setting(
        1,
        "nodes the TP x PP ranks are spread over (without Ray): node rank 0 runs the API server and the scheduler, "
        "the others `kvserve serve --headless` with the same model and flags (docs/multinode.md)",
        type=positive_int,
    )
    node_rank: int = _setting(0, "with --nnodes: this node's index (0: the leader)", type=int)
    master_addr: str = _setting(
        "127.0.0.1", "with --nnodes: the leader's address every node can reach (LWS_LEADER_ADDRESS)", type=str
    )
    master_port: int = _setting(
        29501,
        "with --nnodes: the leader's torch.distributed rendezvous port; the leader's executor also listens "
        "on master_port + 1 for the other nodes' workers",
        type=int,
    )
    device: str | None = _setting(None, "cpu or cuda (default: cuda when available)", hidden=True)
    max_consecutive_step_failures: int = _setting(
        3,
        "declare the engine dead (/health 503, every request answered, the server exits 1) after this many "
        "engine steps in a row fail",
        type=positive_int,
    )

    load_format: str = _setting(
        "auto",
        "auto: read the model directory's safetensors; dummy: random weights made on the device from "
        "config.json alone (benchmarks of a model shape without its checkpoint, as vLLM's dummy format)",
        choices=("auto", "dummy"),
    )
    cuda_graphs: bool = _setting(
        False,
        "capture pure-decode steps as CUDA graphs at start-up (batch sizes --cuda-graph-sizes) and replay "
        "them: one launch per decode step instead of hundreds. Needs CUDA, the triton attention backend, "
        "tensor_parallel_size 1, a model with one KV cache group and no MoE layers",
    )
    cuda_graph_sizes: str | None = _setting(
        None,
        "with --cuda-graphs: comma-separated decode batch sizes to capture, e.g. 1,2,4,8,16,32,64 (default: "
        "1, 2, 4 and every multiple of 8 up to min(max_num_seqs, 512)); a decode step pads to the next "
        "size, larger ones run eagerly",
        type=str,
    )

    enable_lora: bool = _setting(
        False, "serve LoRA adapters (--lora-modules) next to the base model, mixed in one batch (docs/lora.md)"
    )
    lora_modules: str | list | dict | None = _setting(
        None,
        "with --enable-lora: PEFT adapter directories, as vLLM takes them: space-separated name=path items, "
        'or JSON items {"name": ..., "path": ..., "base_model_name": ...} (name=path,name=path also works); '
        "a request selects one by name (the OpenAI `model` field, or LLM.generate(lora_request=name))",
        type=str,
        nargs="+",
    )
    max_loras: int = _setting(1, "with --enable-lora: adapters resident on the device at once", type=positive_int)
    max_lora_rank: int = _setting(16, "with --enable-lora: the largest adapter rank accepted", type=positive_int)
    max_cpu_loras: int | None = _setting(
        None, "with --enable-lora: adapters kept in host memory (default: max_loras)", type=positive_int
    )

    speculative_config: Any = _setting(
        None,
        'speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4} or {"method": "suffix"}; "disable_by_batch_size": N stops drafting '
        "above N running requests (docs/performance.md, Speculative decoding)",
    )
    kv_events_config: Any = _setting(
        None,
        "publish KV cache events in vLLM's format, vLLM's JSON: "
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "kv"} (docs/router.md, KV events)',
    )
    kv_transfer_config: Any = _setting(
        None,
        "prefill/decode disaggregation, vLLM's JSON: "
        '{"kv_connector": "NixlConnector", "kv_role": "kv_producer" | "kv_consumer" | "kv_both", '
        '"kv_connector_extra_config": {"side_channel_port": 5600}}; requests then take kv_transfer_params '
        "(docs/disaggregation.md)",
    )
    enable_sleep_mode: bool = _setting(
        False,
        "vLLM's sleep mode: POST /sleep?level=1|2 frees the KV cache (level 1 keeps the weights in host memory, "
        "level 2 drops them and re-reads the checkpoint on wake), POST /wake_up restores, GET /is_sleeping; "
        "while asleep readiness is 503 and requests get 503 with Retry-After (docs/serving.md, Sleep mode)",
    )
    api_server_count: int = _setting(
        1,
        "`kvserve serve` only: run this many API-server processes (HTTP, tokenisation, detokenisation, "
        "JSON/SSE) on the same host:port (SO_REUSEPORT) in front of one engine core, for tokenisation-heavy "
        "traffic; /metrics on any of them shows the group's sums. 1 (default): one server process",
        type=positive_int,
    )

    # -- construction ----------------------------------------------------------------------------------
    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineArgs":
        """Raises UnknownEngineArgument (a TypeError naming the argument) for a kwarg that is no setting."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise UnknownEngineArgument(
                unknown[0], f"unknown engine argument {unknown[0]!r}; known: {', '.join(sorted(known - {'model'}))}"
            )
        return cls(model=model, **kwargs)

    # -- command line ----------------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
        """Every setting's flag (or only the named ones: `kvserve plan`'s), with the field's type, choices,
        default and help."""
        unknown = sorted(set(only or ()) - {f.name for f in fields(cls)})
        if unknown:
            raise KeyError(f"unknown engine setting(s): {', '.join(unknown)}")
        for f in fields(cls):
            if f.name == "model" or (only is not None and f.name not in only):
                continue
            meta = f.metadata
            flag = meta["flag"] or cli_flag(f.name)
            help_text = argparse.SUPPRESS if meta["hidden"] else meta["help"]
            if isinstance(f.default, bool):
                parser.add_argument(
                    flag,
                    dest=f.name,
                    action=argparse.BooleanOptionalAction,
                    default=f.default,
                    help=f"{help_text} (default: {'on' if f.default else 'off'})" if not meta["hidden"] else help_text,
                )
                continue
            kwargs: dict[str, Any] = dict(dest=f.name, default=f.default, help=help_text, action=_StoreExplicit)
            if meta["type"] is not None:
                kwargs["type"] = meta["type"]
            if meta["choices"]:
                kwargs["choices"] = list(meta["choices"])
            if meta["nargs"]:
                kwargs["nargs"] = meta["nargs"]
            parser.add_argument(flag, *meta["aliases"], **kwargs)

    @staticmethod
    def explicit(namespace: argparse.Namespace) -> frozenset[str]:
        """The settings whose flag was on the command line (a value equal to the default included): `kvserve plan`
        chooses the others itself where it searches them."""
        return frozenset(getattr(namespace, EXPLICIT_ATTR, ()))

    @classmethod
    def from_cli_args(cls, model: str, namespace: argparse.Namespace) -> "EngineArgs":
        """Settings the namespace has no flag for (`kvserve plan` adds only some) keep their defaults."""
        return cls(
            model=model,
            **{
                f.name: getattr(namespace, f.name)
                for f in fields(cls)
                if f.name != "model" and hasattr(namespace, f.name)
            },
        )


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


def default(name: str) -> Any:
    """A setting's default, as EngineArgs defines it (for code that needs one without an EngineArgs)."""
    f = next((f for f in fields(EngineArgs) if f.name == name), None)
    if f is None:
        raise KeyError(f"unknown engine setting {name!r}")
    return f.default


def crd_settings() -> dict[str, str]:
    """Spec path ("engine.maxModelLen") -> engine setting name, for every setting the CRD exposes."""
    return {f.metadata["crd"]: f.name for f in fields(EngineArgs) if f.metadata["crd"]}


def crd_choices() -> dict[str, tuple]:
    """Spec path -> the values the CRD's enum allows, for every CRD setting that has one (the EngineArgs
    choices, or the operator's narrower crd_choices where it says why)."""
    out = {}
    for f in fields(EngineArgs):
        choices = f.metadata["crd_choices"] or f.metadata["choices"]
        if f.metadata["crd"] and choices:
            out[f.metadata["crd"]] = tuple(choices)
    return out


def crd_defaults() -> dict[str, Any]:
    """Spec path -> the default the operator applies (the engine's own unless a crd_default is given)."""
    out = {}
    for f in fields(EngineArgs):
        if f.metadata["crd"]:
            crd_default = f.metadata["crd_default"]
            out[f.metadata["crd"]] = f.default if crd_default is MISSING else crd_default
    return out


# -- model-dependent defaults, resolved once for serve, LLM and plan -----------------------------------------
@dataclass(frozen=True)
class ResolvedSettings:
    """The engine settings a model is served with once its config.json (or catalog shape) is known: what
    `kvserve serve DIR` runs and what `kvserve plan --model-config DIR` plans."""

    dtype: str  # weights: float32 | bfloat16 | float16 | fp8 ("auto" resolved)
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    kv_cache_dtype: str  # auto | fp8_e4m3 | fp8_e5m2 ("fp8" spelled out)
    enable_chunked_prefill: bool
    tensor_parallel_size: int
    gpu_memory_utilization: float


# -- rules more than one caller checks (the scheduler's config, resolve, build_engine_config, the operator's spec);
# each returns the refusal (None: fine) and the caller raises it as its own error type -----------------------
def preemption_mode_error(mode: Any) -> str | None:
    if mode in PREEMPTION_MODES:
        return None
    return f"preemption_mode must be {' or '.join(map(repr, PREEMPTION_MODES))}, got {mode!r}"


def chunked_prefill_budget_error(
    enable_chunked_prefill: bool,
    max_num_batched_tokens: int,
    max_model_len: int,
    names: tuple[str, str] = ("max_num_batched_tokens", "max_model_len"),
) -> str | None:
    """Without chunked prefill a prompt is scheduled whole, so the step budget must hold the longest one.
    `names`: how the caller spells the two settings (the operator's spec: maxNumBatchedTokens, maxModelLen)."""
    if enable_chunked_prefill or max_num_batched_tokens >= max_model_len:
        return None
    return (
        f"without chunked prefill, {names[0]} ({max_num_batched_tokens}) must be >= {names[1]} "
        f"({max_model_len}) so any prompt fits one step"
    )


def resolve_dtype(dtype: str, auto_dtype: str) -> str:
    """`--dtype` as the canonical weight dtype; "auto" is `auto_dtype` (capacity.checkpoint_dtype of the
    model's config.json). InvalidParameter("dtype") for anything else."""
    auto = str(dtype).strip().lower() == "auto"
    try:
        return capacity.weight_dtype(auto_dtype if auto else dtype)
    except capacity.CapacityError as exc:
        if auto:
            raise InvalidParameter(
                "dtype",
                f"dtype auto: the model's config.json declares dtype {auto_dtype!r}, "
                f"which the runtime does not load; give dtype, one of "
                f"{', '.join(CRD_DTYPES)}",
            ) from None
        raise InvalidParameter("dtype", str(exc)) from None


def resolve_max_model_len(max_model_len: int | None, context_limit: int) -> int:
    """None -> the model's context limit (capacity.context_limit); else it must lie in [1, limit]."""
    if max_model_len is None:
        return context_limit
    if not 1 <= max_model_len <= context_limit:
        raise InvalidParameter(
            "max_model_len",
            f"max_model_len must be in [1, {context_limit}] for this model "
            f"(max_position_embeddings / sliding window), got {max_model_len}",
        )
    return max_model_len


def resolve_kv_cache_dtype(name: str) -> str:
    key = "fp8_e4m3" if name == "fp8" else name  # vLLM's spelling: e4m3
    if key not in capacity.KV_CACHE_DTYPES:
        raise InvalidParameter(
            "kv_cache_dtype", f"kv_cache_dtype must be one of {', '.join(capacity.KV_CACHE_DTYPES)}, got {name!r}"
        )
    return key


def resolve(args: EngineArgs, context_limit: int, auto_dtype: str) -> ResolvedSettings:
    """Validate the settings a capacity plan depends on (InvalidParameter names the field) and fill in the
    defaults that depend on the model: `context_limit` and `auto_dtype` come from the model's config.json
    (`resolve_for_config`) or, for a catalog shape, from the shape and the operator's dtype default."""
    if args.block_size not in BLOCK_SIZES:
        raise InvalidParameter("block_size", f"block_size must be one of {BLOCK_SIZES}, got {args.block_size}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise InvalidParameter(
            "gpu_memory_utilization", f"gpu_memory_utilization must be in (0, 1], got {args.gpu_memory_utilization}"
        )
    if args.tensor_parallel_size < 1:
        raise InvalidParameter(
            "tensor_parallel_size", f"tensor_parallel_size must be >= 1, got {args.tensor_parallel_size}"
        )
    if args.max_num_seqs < 1:
        raise InvalidParameter("max_num_seqs", f"max_num_seqs must be >= 1, got {args.max_num_seqs}")
    kv_cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype)
    dtype = resolve_dtype(args.dtype, auto_dtype)
    max_model_len = resolve_max_model_len(args.max_model_len, context_limit)
    batched = args.max_num_batched_tokens
    if batched is None:
        batched = CHUNKED_PREFILL_BATCHED_TOKENS if args.enable_chunked_prefill else max_model_len
    if batched < 1:
        raise InvalidParameter("max_num_batched_tokens", f"max_num_batched_tokens must be >= 1, got {batched}")
    error = chunked_prefill_budget_error(args.enable_chunked_prefill, batched, max_model_len)
    if error:
        raise InvalidParameter("max_num_batched_tokens", error)
    return ResolvedSettings(
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_batched_tokens=batched,
        max_num_seqs=args.max_num_seqs,
        block_size=args.block_size,
        kv_cache_dtype=kv_cache_dtype,
        enable_chunked_prefill=args.enable_chunked_prefill,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )


def resolve_for_config(args: EngineArgs, config: dict, source: str = "config.json") -> ResolvedSettings:
    """`resolve` for a model's config.json (a dict): what `kvserve serve` runs for that model directory.
    InvalidParameter("model") for a config the runtime does not serve (rope type, architecture); `source`
    names the file in that message."""
    error = capacity.unsupported_config_error(config, source)
    if error:
        raise InvalidParameter("model", error)
    return resolve(args, capacity.context_limit(config), capacity.checkpoint_dtype(config))

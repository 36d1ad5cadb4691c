"""Engine configuration: frozen dataclasses, validated once where they are built (LLM / CLI kwargs)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from kvserve.runtime import capacity, cuda_graph_settings, engine_args
from kvserve.runtime.capacity import PIPELINE_ARCHITECTURES, SUPPORTED_ARCHITECTURES
from kvserve.runtime.core.scheduler import SchedulerConfig
from kvserve.runtime.errors import InvalidParameter
from kvserve.runtime.kv_events.config import KVEventsConfig, parse_kv_events_config
from kvserve.runtime.kv_transfer.config import KVTransferConfig, parse_kv_transfer_config
from kvserve.runtime.speculative_config import SpeculativeConfig, parse_speculative_config

logger = logging.getLogger(__name__)

ALLOWED_BLOCK_SIZES = engine_args.BLOCK_SIZES
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class ModelConfig:
    """The model facts the engine needs, read from config.json as a dict (capacity's parsing, torch-free).

    `hf_config`, transformers' config object the model code is built from, is loaded on first use in each
    process and never pickled: importing transformers' config classes costs seconds (they pull in torch,
    torch.distributed and accelerate), and the API server that builds this config never needs it, so a
    `kvserve serve` hands the config to its engine-core process without paying for it (issue 43)."""

    model_dir: str
    architecture: str
    dtype: str  # activations: "float32" | "bfloat16" | "float16"
    max_model_len: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    shape: capacity.ModelShape = field(compare=False, repr=False, default=None)
    weight_dtype: str = ""  # "fp8" for online-quantised weights, else == dtype
    _hf_config: Any = field(default=None, init=False, compare=False, repr=False)  # loaded by hf_config

    @property
    def hf_config(self) -> Any:
        """transformers' AutoConfig of model_dir, loaded on first use in this process."""
        if self._hf_config is None:
            object.__setattr__(self, "_hf_config", load_hf_config(self.model_dir))
        return self._hf_config

    def __getstate__(self) -> dict:
        """Pickled without hf_config: unpickling it would import transformers' config classes wherever the
        config goes (the API server gets the core's config back in CoreReady); the receiver reloads it."""
        return {**self.__dict__, "_hf_config": None}

    def kv_layout(self, kv_cache_dtype: str, block_size: int, tensor_parallel_size: int = 1) -> capacity.KVLayout:
        return capacity.kv_layout(self.shape, self.weight_dtype, kv_cache_dtype, block_size, tensor_parallel_size)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = engine_args.default("block_size")
    enable_prefix_caching: bool = engine_args.default("enable_prefix_caching")
    kv_cache_bytes: int | None = None
    num_kv_blocks: int | None = None  # explicit override (tests force preemption with it)
    gpu_memory_utilization: float = engine_args.default("gpu_memory_utilization")
    kv_cache_dtype: str = engine_args.default("kv_cache_dtype")
    swap_space_bytes: int = 0  # host RAM for preemption_mode="swap" (resolved: 0 without swap)
    kv_offloading_bytes: int = 0  # the host KV tier, in total over the ranks (--kv-offloading-size; 0: off)
    kv_offloading_disk_dir: str | None = None  # the disk tier below it (--kv-offloading-disk-dir)
    kv_offloading_disk_bytes: int = 0
    kv_offloading_remote_url: str | None = None  # the remote tier (--kv-offloading-remote-url; Redis / Valkey)
    num_blocks: int = 0  # filled in (a new frozen object) once the runner has sized the cache
    # ... and the element order of a block its attention backend keeps ("token", or "amx-bf16" on AMX CPUs:
    # models/attention_cpu.py), filled in the same way
    kv_block_layout: str = "token"


@dataclass(frozen=True)
class LoraConfig:
    modules: tuple[tuple[str, str], ...]  # (adapter name, PEFT directory), loaded at start-up
    max_loras: int = engine_args.default("max_loras")
    max_lora_rank: int = engine_args.default("max_lora_rank")
    max_cpu_loras: int = engine_args.default("max_loras")  # resolved: --max-cpu-loras, at least max_loras


def _lora_module_pairs(value) -> list[tuple[str, str]]:
    """vLLM's --lora-modules items (a list: "name=path", or JSON {"name", "path", "base_model_name"}), kvserve's
    "a=/p/a,b=/p/b" string, or a {name: path} dict -> [(name, path), ...]."""
    if isinstance(value, dict):
        return list(value.items())
    pairs = []
    for item in value if isinstance(value, (list, tuple)) else [value]:
        text = item if isinstance(item, dict) else str(item).strip()
        if isinstance(text, str) and text.startswith("{"):
            try:
                text = json.loads(text)
            except ValueError as exc:
                raise InvalidParameter("lora_modules", f"lora_modules: {item!r} is not valid JSON: {exc}") from None
        if isinstance(text, dict):  # vLLM's LoRAModulePath; base_model_name only labels the adapter there
            unknown = set(text) - {"name", "path", "base_model_name"}
            if unknown or "name" not in text or "path" not in text:
                raise InvalidParameter(
                    "lora_modules",
                    f'lora_modules: a JSON item needs "name" and "path" (and at most "base_model_name"), got {item!r}',
                )
            pairs.append((text["name"], text["path"]))
        else:
            pairs += [part.partition("=")[::2] for part in text.split(",")]
    return pairs


def parse_lora_modules(value) -> tuple[tuple[str, str], ...]:
    """--lora-modules in any of vLLM's forms (see _lora_module_pairs) -> ((name, path), ...); InvalidParameter
    naming lora_modules."""
    if not value:
        return ()
    out = tuple((str(n).strip(), str(p).strip()) for n, p in _lora_module_pairs(value))
    names = [n for n, _ in out]
    if any(not n or not p for n, p in out) or len(set(names)) != len(names):
        raise InvalidParameter("lora_modules", f"lora_modules must be distinct name=path pairs, got {value!r}")
    return out


PP_LAYER_PARTITION_ENV = "KVSERVE_PP_LAYER_PARTITION"  # vLLM's VLLM_PP_LAYER_PARTITION: "16,15,..."


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over worker processes beyond tensor parallelism: pipeline_parallel_size stages,
    each of EngineConfig.tensor_parallel_size ranks (world = TP x PP; global rank = stage * TP + TP rank, as
    in vLLM). stage_layers: the decoder layers of each stage (capacity.stage_layer_ranges: balanced by
    count, earlier stages taking the remainder, unless --pipeline-layer-split gives the counts)."""

    pipeline_parallel_size: int = engine_args.default("pipeline_parallel_size")
    stage_layers: tuple[range, ...] = ()  # one range per stage; () with pipeline_parallel_size 1
    # Multi-node (no Ray): the world's ranks split evenly over nnodes nodes, node k running ranks
    # [k * world / nnodes, (k + 1) * world / nnodes); the leader (node 0) schedules (executor/multinode.py).
    nnodes: int = engine_args.default("nnodes")
    node_rank: int = engine_args.default("node_rank")
    master_addr: str = engine_args.default("master_addr")
    master_port: int = engine_args.default("master_port")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    tensor_parallel_size: int = engine_args.default("tensor_parallel_size")
    attention_backend: str = "torch"  # resolved (EngineArgs' None: chosen for the device)
    device: str = "cpu"  # resolved (EngineArgs' None: cuda when available)
    seed: int = engine_args.default("seed")
    structured_output_max_number_digits: int = engine_args.default("structured_output_max_number_digits")
    # The engine is declared dead (every request answered with an error, the server exits non-zero) after
    # this many steps in a row fail in a way no single request explains (see engine/errors.py).
    max_consecutive_step_failures: int = engine_args.default("max_consecutive_step_failures")
    load_format: str = engine_args.default("load_format")  # "dummy": random weights from config.json (models/loader.py)
    # Decode batch sizes captured as CUDA graphs (worker/cuda_graphs.py); empty: every step runs eagerly.
    cuda_graph_sizes: tuple[int, ...] = ()
    lora: LoraConfig | None = None  # --enable-lora (runtime/lora/)
    parallel: ParallelConfig = ParallelConfig()  # pipeline stages (tensor_parallel_size above is per stage)
    speculative: SpeculativeConfig | None = None  # --speculative-config (runtime/spec_decode/)
    kv_events: KVEventsConfig | None = None  # --kv-events-config (runtime/kv_events/)
    kv_transfer: KVTransferConfig | None = None  # --kv-transfer-config (runtime/kv_transfer/, P/D disaggregation)
    enable_sleep_mode: bool = engine_args.default("enable_sleep_mode")  # /sleep, /wake_up (engine/sleep_control.py)

    @property
    def pipeline_parallel_size(self) -> int:
        return self.parallel.pipeline_parallel_size

    @property
    def world_size(self) -> int:
        """Worker processes (ranks) the model runs in; 1: in the engine process itself."""
        return self.tensor_parallel_size * self.parallel.pipeline_parallel_size


def read_config_json(model_dir: str) -> dict:
    """A local Hugging Face model directory's config.json as a dict (never a hub download)."""
    if not os.path.isdir(model_dir):
        raise InvalidParameter("model", f"model directory {model_dir!r} does not exist")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise InvalidParameter("model", f"model directory {model_dir!r} has no config.json")
    with open(path) as f:
        return json.load(f)


def load_model_config(
    model_dir: str, dtype: str = engine_args.default("dtype"), max_model_len: int | None = None
) -> ModelConfig:
    """Read a local Hugging Face model directory's config.json. dtype "auto" and max_model_len None resolve
    as engine_args.resolve does (the architecture, RoPE, context limit and dtype facts are capacity's)."""
    config = read_config_json(model_dir)
    error = capacity.unsupported_config_error(config, f"{model_dir}/config.json")
    if error:
        raise InvalidParameter("model", error)
    arch = next(a for a in config["architectures"] if a in SUPPORTED_ARCHITECTURES)
    weight_dtype = engine_args.resolve_dtype(dtype, capacity.checkpoint_dtype(config))
    max_model_len = engine_args.resolve_max_model_len(max_model_len, capacity.context_limit(config))
    shape = capacity.shape_from_hf_config(config)
    hf_config = None  # loaded only where config.json leaves the EOS token to the architecture's default
    if "eos_token_id" in config:
        config_eos = config["eos_token_id"]
    else:
        hf_config = load_hf_config(model_dir)
        config_eos = getattr(hf_config, "eos_token_id", None)
    model = ModelConfig(
        model_dir=model_dir,
        architecture=arch,
        dtype=capacity.activation_dtype(weight_dtype),
        max_model_len=max_model_len,
        num_layers=shape.num_layers,
        num_heads=shape.num_attention_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        hidden_size=shape.hidden_size,
        vocab_size=shape.vocab_size,
        eos_token_ids=_eos_token_ids(model_dir, config_eos),
        shape=shape,
        weight_dtype=weight_dtype,
    )
    if hf_config is not None:
        object.__setattr__(model, "_hf_config", hf_config)
    return model


def load_hf_config(model_dir: str) -> Any:
    """transformers' AutoConfig of a local model directory (never a hub download)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir, local_files_only=True)


def _eos_token_ids(model_dir: str, config_eos: Any) -> tuple[int, ...]:
    """config.json's eos_token_id (transformers keeps the file's value as is) and generation_config.json's."""
    ids: set[int] = set()
    for source in (config_eos, _generation_config(model_dir).get("eos_token_id")):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(int(i) for i in source)
    return tuple(sorted(ids))


def _generation_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def make_engine_config(model: str, **kwargs) -> EngineConfig:
    """`LLM(model, **kwargs)` / `LLMEngine.from_kwargs`: kwargs are EngineArgs fields (their defaults live
    there, once)."""
    from kvserve.runtime import gguf_model_dir
    from kvserve.runtime.engine_args import EngineArgs, UnknownEngineArgument

    try:
        args = EngineArgs.from_kwargs(model, **kwargs)
    except UnknownEngineArgument as exc:
        raise InvalidParameter(exc.name, str(exc)) from None
    args.model = gguf_model_dir.resolve(args.model, args.tokenizer)  # MODEL.gguf -> its prepared directory
    if args.api_server_count != 1:  # a process layout of `kvserve serve`; an engine built here has no HTTP side
        raise InvalidParameter(
            "api_server_count",
            "api_server_count is a `kvserve serve` setting "
            "(--api-server-count); an engine built in-process has no API server",
        )
    return build_engine_config(args)


def build_engine_config(args) -> EngineConfig:
    """Validate an EngineArgs once (errors name the field) and build the frozen configs."""
    a = args
    # Settings the validation below normalises get local names; the rest are read from `a` directly.
    swap_space_bytes, kv_cache_bytes = a.swap_space_bytes, a.kv_cache_bytes
    device, attention_backend = a.device, a.attention_backend
    if kv_cache_bytes is not None and kv_cache_bytes <= 0:
        raise InvalidParameter("kv_cache_bytes", f"kv_cache_bytes must be > 0, got {kv_cache_bytes}")
    if a.num_kv_blocks is not None and a.num_kv_blocks < 2:
        raise InvalidParameter("num_kv_blocks", f"num_kv_blocks must be >= 2, got {a.num_kv_blocks}")
    if not isinstance(a.max_consecutive_step_failures, int) or a.max_consecutive_step_failures < 1:
        raise InvalidParameter(
            "max_consecutive_step_failures",
            f"max_consecutive_step_failures must be an integer >= 1, got {a.max_consecutive_step_failures!r}",
        )
    preemption_error = engine_args.preemption_mode_error(a.preemption_mode)
    if preemption_error:
        raise InvalidParameter("preemption_mode", preemption_error)
    if swap_space_bytes is None:
        swap_space_bytes = engine_args.DEFAULT_SWAP_SPACE_BYTES if a.preemption_mode == "swap" else 0
    if a.kv_offloading_size is not None and not a.kv_offloading_size >= 0:
        raise InvalidParameter(
            "kv_offloading_size", f"kv_offloading_size must be >= 0 GiB, got {a.kv_offloading_size!r}"
        )
    if a.kv_offloading_size and not a.enable_prefix_caching:
        raise InvalidParameter("kv_offloading_size", "kv_offloading_size needs enable_prefix_caching")
    if a.kv_offloading_disk_dir:
        if not a.kv_offloading_size:
            raise InvalidParameter(
                "kv_offloading_disk_dir", "the disk tier is staged through the host tier: it needs kv_offloading_size"
            )
        if not a.kv_offloading_disk_size or a.kv_offloading_disk_size <= 0:
            raise InvalidParameter(
                "kv_offloading_disk_size", "kv_offloading_disk_dir needs kv_offloading_disk_size > 0 GiB"
            )
    elif a.kv_offloading_disk_size:
        raise InvalidParameter("kv_offloading_disk_size", "kv_offloading_disk_size needs kv_offloading_disk_dir")
    _check_remote_url(a)
    if swap_space_bytes < 0:
        raise InvalidParameter("swap_space_bytes", f"swap_space_bytes must be >= 0, got {swap_space_bytes}")
    # The model-dependent defaults (dtype auto, max_model_len, max_num_batched_tokens) and the settings a plan
    # depends on, resolved by the one torch-free function `kvserve plan` calls too.
    settings = engine_args.resolve_for_config(a, read_config_json(a.model), f"{a.model}/config.json")
    kv_cache_dtype, max_num_batched_tokens = settings.kv_cache_dtype, settings.max_num_batched_tokens
    model_config = load_model_config(a.model, settings.dtype, settings.max_model_len)
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if attention_backend is None:  # CPU: the compiled ops when they build/load, else torch (one log line)
        attention_backend = "triton" if device.startswith("cuda") else default_cpu_backend()
    if kv_cache_bytes is None and a.num_kv_blocks is None and device == "cpu":
        kv_cache_bytes = DEFAULT_CPU_KV_CACHE_BYTES
    try:
        scheduler = SchedulerConfig(
            max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=model_config.max_model_len,
            enable_chunked_prefill=a.enable_chunked_prefill,
            long_prefill_token_threshold=a.long_prefill_token_threshold,
            preemption_mode=a.preemption_mode,
            max_loras=a.max_loras if a.enable_lora else 0,
        )
    except ValueError as exc:
        message = str(exc)
        field_name = "max_num_batched_tokens" if message.startswith("without") else message.split(" ", 1)[0]
        raise InvalidParameter(field_name, message) from None
    if a.load_format not in ("auto", "dummy"):
        raise InvalidParameter("load_format", f"load_format must be 'auto' or 'dummy', got {a.load_format!r}")
    cuda_graph_sizes = cuda_graph_settings.capture_sizes(a, model_config, device, attention_backend)
    lora = None
    if a.enable_lora:
        lora = LoraConfig(
            parse_lora_modules(a.lora_modules),
            a.max_loras,
            a.max_lora_rank,
            max(a.max_cpu_loras or a.max_loras, a.max_loras),
        )
    elif a.lora_modules:
        raise InvalidParameter("lora_modules", "lora_modules needs enable_lora")
    parallel = build_parallel_config(a, model_config, bool(cuda_graph_sizes))
    kv_transfer = parse_kv_transfer_config(a.kv_transfer_config)
    if kv_transfer is not None:
        if a.pipeline_parallel_size > 1:
            raise InvalidParameter(
                "kv_transfer_config",
                "kv_transfer_config needs pipeline_parallel_size 1 (per-stage pulls are not implemented)",
            )
        if a.enable_sleep_mode:
            raise InvalidParameter(
                "kv_transfer_config",
                "kv_transfer_config cannot be combined with enable_sleep_mode (NIXL registers the KV cache)",
            )
        if device != "cpu":
            raise InvalidParameter("kv_transfer_config", "kv_transfer_config is implemented for the CPU KV cache only")
    cache = CacheConfig(
        block_size=a.block_size,
        enable_prefix_caching=a.enable_prefix_caching,
        kv_cache_bytes=kv_cache_bytes,
        num_kv_blocks=a.num_kv_blocks,
        gpu_memory_utilization=a.gpu_memory_utilization,
        kv_cache_dtype=kv_cache_dtype,
        swap_space_bytes=swap_space_bytes,
        kv_offloading_bytes=engine_args.kv_offloading_bytes(a.kv_offloading_size),
        kv_offloading_disk_dir=a.kv_offloading_disk_dir,
        kv_offloading_disk_bytes=engine_args.kv_offloading_bytes(a.kv_offloading_disk_size),
        kv_offloading_remote_url=a.kv_offloading_remote_url or None,
    )
    return EngineConfig(
        model=model_config,
        cache=cache,
        scheduler=scheduler,
        tensor_parallel_size=a.tensor_parallel_size,
        attention_backend=attention_backend,
        device=device,
        seed=a.seed,
        structured_output_max_number_digits=a.structured_output_max_number_digits,
        max_consecutive_step_failures=a.max_consecutive_step_failures,
        load_format=a.load_format,
        enable_sleep_mode=bool(a.enable_sleep_mode),
        cuda_graph_sizes=cuda_graph_sizes,
        lora=lora,
        parallel=parallel,
        speculative=parse_speculative_config(a.speculative_config),
        kv_events=parse_kv_events_config(a.kv_events_config),
        kv_transfer=kv_transfer,
    )


def _check_remote_url(a) -> None:
    """--kv-offloading-remote-url: a redis:// (or rediss://, unix://) URL, staged through the host tier."""
    url = a.kv_offloading_remote_url
    if not url:
        return
    if not a.kv_offloading_size:
        raise InvalidParameter(
            "kv_offloading_remote_url", "the remote tier is staged through the host tier: it needs kv_offloading_size"
        )
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise InvalidParameter(
            "kv_offloading_remote_url",
            f"kv_offloading_remote_url must be a redis://, rediss:// or unix:// URL (Redis / Valkey), got {url!r}",
        )
    import importlib.util

    if importlib.util.find_spec("redis") is None:
        raise InvalidParameter(
            "kv_offloading_remote_url", "the remote tier needs the redis client: pip install 'kvserve[kvremote]'"
        )


def build_parallel_config(a, model_config: ModelConfig, cuda_graphs: bool) -> ParallelConfig:
    """--pipeline-parallel-size / --pipeline-layer-split (or $KVSERVE_PP_LAYER_PARTITION), validated before any
    worker starts; errors name the field."""
    pp = a.pipeline_parallel_size
    if not isinstance(pp, int) or pp < 1:
        raise InvalidParameter("pipeline_parallel_size", f"pipeline_parallel_size must be an integer >= 1, got {pp!r}")
    nodes = _node_settings(a, a.tensor_parallel_size * pp)
    if pp == 1:
        if a.pipeline_layer_split is not None:
            raise InvalidParameter("pipeline_layer_split", "pipeline_layer_split needs pipeline_parallel_size > 1")
        return ParallelConfig(**nodes)  # $KVSERVE_PP_LAYER_PARTITION only matters to a pipelined engine
    if model_config.architecture not in PIPELINE_ARCHITECTURES:
        raise InvalidParameter(
            "pipeline_parallel_size",
            f"pipeline_parallel_size > 1 does not support {model_config.architecture} yet "
            f"(supported: {', '.join(PIPELINE_ARCHITECTURES)})",
        )
    if len(capacity.shape_kv_cache_groups(model_config.shape)) > 1:
        raise InvalidParameter(
            "pipeline_parallel_size", "pipeline_parallel_size > 1 does not support sliding-window KV cache groups yet"
        )
    if a.enable_lora:
        raise InvalidParameter("enable_lora", "enable_lora needs pipeline_parallel_size 1")
    if cuda_graphs:
        raise InvalidParameter("cuda_graphs", "cuda_graphs needs pipeline_parallel_size 1")
    if getattr(a, "speculative_config", None):  # as in vLLM: drafts and verification run on one stage
        raise InvalidParameter("speculative_config", "speculative_config needs pipeline_parallel_size 1")
    split_text = a.pipeline_layer_split
    if split_text is None:
        split_text = os.environ.get(PP_LAYER_PARTITION_ENV) or None
    split: tuple[int, ...] = ()
    if split_text is not None:
        text = split_text if isinstance(split_text, str) else ",".join(map(str, split_text))
        try:
            split = tuple(engine_args.positive_int_list(text))
        except ValueError as exc:
            raise InvalidParameter("pipeline_layer_split", f"pipeline_layer_split: {exc}") from None
    try:
        ranges = capacity.stage_layer_ranges(model_config.num_layers, pp, split)
    except ValueError as exc:
        message = str(exc)
        name = "pipeline_layer_split" if message.startswith("pipeline_layer_split") else "pipeline_parallel_size"
        raise InvalidParameter(name, message) from None
    return ParallelConfig(pipeline_parallel_size=pp, stage_layers=ranges, **nodes)


def _node_settings(a, world: int) -> dict:
    """--nnodes / --node-rank / --master-addr / --master-port, checked against the world size."""
    nnodes, node_rank = a.nnodes, a.node_rank
    if not isinstance(nnodes, int) or nnodes < 1:
        raise InvalidParameter("nnodes", f"nnodes must be an integer >= 1, got {nnodes!r}")
    if not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        raise InvalidParameter("node_rank", f"node_rank must be in [0, nnodes={nnodes}), got {node_rank!r}")
    if nnodes > 1 and (world < nnodes or world % nnodes):
        raise InvalidParameter(
            "nnodes",
            f"nnodes={nnodes} must divide the world of tensor_parallel_size x pipeline_parallel_size = {world} "
            f"ranks (each node runs the same number of them)",
        )
    if not isinstance(a.master_port, int) or not 1 <= a.master_port < 65535:
        raise InvalidParameter("master_port", f"master_port must be in [1, 65534], got {a.master_port!r}")
    return dict(nnodes=nnodes, node_rank=node_rank, master_addr=str(a.master_addr), master_port=a.master_port)


SLEEP_LEVELS = (1, 2)  # --enable-sleep-mode: 1 frees the KV cache, 2 the weights too (executor/sleep_mode.py)

_DEFAULT_CPU: list[str] = []  # the choice, made once per process


def default_cpu_backend() -> str:
    """The CPU attention default: 'cpu' (the compiled ops of kvserve.kernels.cpu_ops) when they build and
    load, else 'torch'. Logs one line, once per process, saying which backend runs and why.

    With KVSERVE_CPU_OPS_BUILD=background (`kvserve serve` sets it unless given) a library not built yet is
    not waited for: this run takes 'torch' at once and a background process builds the library, which the next
    start loads (kvkernels/cpu_ops_build.py says why not mid-run). The default, 'wait', builds first, so the
    offline API, benchmarks and tests run the compiled path wherever it can build."""
    if not _DEFAULT_CPU:
        from kvserve.kernels import cpu_ops, cpu_ops_build

        try:
            mode = cpu_ops_build.build_mode()
        except ValueError as exc:
            raise InvalidParameter(cpu_ops_build.BUILD_MODE_ENV, str(exc)) from None
        if mode == "background" and cpu_ops.enabled() and not cpu_ops.is_built():
            proc, log_path = cpu_ops_build.start_background_build()
            _DEFAULT_CPU.append("torch")
            logger.warning(
                "CPU attention backend 'torch' for this run: the compiled CPU ops %s are not built yet; %s "
                "(log %s). The next start uses them once built (a failed build leaves the reason in that log).",
                cpu_ops.extension_name(),
                f"building them in the background (pid {proc.pid})" if proc else "another process is building them",
                log_path,
            )
        elif cpu_ops.load():
            _DEFAULT_CPU.append("cpu")
            logger.info("CPU attention backend 'cpu': %s", cpu_ops.describe())
        else:
            _DEFAULT_CPU.append("torch")
            logger.warning("CPU attention backend 'torch' (pure-torch fallback): %s", cpu_ops.unavailable_reason())
    return _DEFAULT_CPU[0]

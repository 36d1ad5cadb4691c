"""Engine configuration: frozen dataclasses, validated once where they are built (LLM / CLI kwargs)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from kvserve.runtime import capacity
from kvserve.runtime.capacity import SUPPORTED_ARCHITECTURES, CapacityError
from kvserve.runtime.core.scheduler import SchedulerConfig
from kvserve.runtime.sampling_params import InvalidParameter

ALLOWED_BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
DEFAULT_SWAP_SPACE_BYTES = 4 << 30  # vLLM's default swap space


@dataclass(frozen=True)
class ModelConfig:
    model_dir: str
    architecture: str
    hf_config: Any = field(compare=False, repr=False)
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

    def kv_layout(self, kv_cache_dtype: str, block_size: int, tensor_parallel_size: int = 1) -> capacity.KVLayout:
        return capacity.kv_layout(self.shape, self.weight_dtype, kv_cache_dtype, block_size, tensor_parallel_size)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_bytes: int | None = None
    num_kv_blocks: int | None = None  # explicit override (tests force preemption with it)
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    swap_space_bytes: int = 0  # host RAM for preemption_mode="swap"
    num_blocks: int = 0  # filled in (a new frozen object) once the runner has sized the cache


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    tensor_parallel_size: int = 1
    attention_backend: str = "torch"
    device: str = "cpu"
    seed: int = 0
    # The engine is declared dead (every request answered with an error, the server exits non-zero) after
    # this many steps in a row fail in a way no single request explains (see engine/errors.py).
    max_consecutive_step_failures: int = 3
    load_format: str = "auto"  # "dummy": random weights from config.json (models/loader.py)
    # Decode batch sizes captured as CUDA graphs (worker/cuda_graphs.py); empty: every step runs eagerly.
    cuda_graph_sizes: tuple[int, ...] = ()


def load_model_config(model_dir: str, dtype: str = "auto", max_model_len: int | None = None) -> ModelConfig:
    """Read a local Hugging Face model directory's config.json (never a hub download)."""
    if not os.path.isdir(model_dir):
        raise InvalidParameter("model", f"model directory {model_dir!r} does not exist")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise InvalidParameter("model", f"model directory {model_dir!r} has no config.json")
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    archs = getattr(hf_config, "architectures", None) or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise InvalidParameter("model", f"unsupported architecture {archs or hf_config.model_type!r} in "
                                        f"{model_dir}/config.json; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if dtype == "auto":
        dtype = str(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "float32")
    try:
        weight_dtype = capacity.weight_dtype(dtype)
    except CapacityError as exc:
        raise InvalidParameter("dtype", str(exc)) from None
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in ("dynamic", "longrope"):
        # Their frequencies change with the running sequence length; the model precomputes one table.
        raise InvalidParameter("model", f"rope_type {rope_type!r} in {model_dir}/config.json is not supported "
                                        f"(supported: default, linear, llama3, yarn)")
    limit = int(getattr(hf_config, "max_position_embeddings", 0) or 0) or 4096
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True) and arch not in capacity.GEMMA_ARCHITECTURES:
        # (Gemma models implement sliding-window layers: runtime/models/gemma.py.)
        # No sliding-window attention yet: keep every sequence inside the window, where it is exact.
        limit = min(limit, int(window))
    if max_model_len is None:
        max_model_len = limit
    elif not 1 <= max_model_len <= limit:
        raise InvalidParameter("max_model_len", f"max_model_len must be in [1, {limit}] for this model "
                                                f"(max_position_embeddings / sliding window), got {max_model_len}")
    with open(os.path.join(model_dir, "config.json")) as f:
        shape = capacity.shape_from_hf_config(json.load(f))
    return ModelConfig(
        model_dir=model_dir, architecture=arch, hf_config=hf_config, dtype=capacity.activation_dtype(weight_dtype),
        max_model_len=max_model_len, num_layers=shape.num_layers, num_heads=shape.num_attention_heads,
        num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, hidden_size=shape.hidden_size,
        vocab_size=shape.vocab_size, eos_token_ids=_eos_token_ids(model_dir, hf_config), shape=shape,
        weight_dtype=weight_dtype)


def _eos_token_ids(model_dir: str, hf_config: Any) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (getattr(hf_config, "eos_token_id", None), _generation_config(model_dir).get("eos_token_id")):
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
    from kvserve.runtime.engine_args import EngineArgs, UnknownEngineArgument

    try:
        args = EngineArgs.from_kwargs(model, **kwargs)
    except UnknownEngineArgument as exc:
        raise InvalidParameter(exc.name, str(exc)) from None
    if args.api_server_count != 1:  # a process layout of `kvserve serve`; an engine built here has no HTTP side
        raise InvalidParameter("api_server_count", "api_server_count is a `kvserve serve` setting "
                                                   "(--api-server-count); an engine built in-process has no API server")
    return build_engine_config(args)


def build_engine_config(args) -> EngineConfig:
    """Validate an EngineArgs once (errors name the field) and build the frozen configs."""
    a = args
    # Settings the validation below normalises get local names; the rest are read from `a` directly.
    kv_cache_dtype, swap_space_bytes, kv_cache_bytes = a.kv_cache_dtype, a.swap_space_bytes, a.kv_cache_bytes
    device, attention_backend, max_num_batched_tokens = a.device, a.attention_backend, a.max_num_batched_tokens
    if a.block_size not in ALLOWED_BLOCK_SIZES:
        raise InvalidParameter("block_size", f"block_size must be one of {ALLOWED_BLOCK_SIZES}, got {a.block_size}")
    if kv_cache_bytes is not None and kv_cache_bytes <= 0:
        raise InvalidParameter("kv_cache_bytes", f"kv_cache_bytes must be > 0, got {kv_cache_bytes}")
    if a.num_kv_blocks is not None and a.num_kv_blocks < 2:
        raise InvalidParameter("num_kv_blocks", f"num_kv_blocks must be >= 2, got {a.num_kv_blocks}")
    if not 0 < a.gpu_memory_utilization <= 1:
        raise InvalidParameter("gpu_memory_utilization",
                               f"gpu_memory_utilization must be in (0, 1], got {a.gpu_memory_utilization}")
    if kv_cache_dtype == "fp8":  # vLLM's spelling: e4m3
        kv_cache_dtype = "fp8_e4m3"
    if kv_cache_dtype not in capacity.KV_CACHE_DTYPES:
        raise InvalidParameter("kv_cache_dtype", f"kv_cache_dtype must be one of {', '.join(capacity.KV_CACHE_DTYPES)}, "
                                                 f"got {kv_cache_dtype!r}")
    if a.tensor_parallel_size < 1:
        raise InvalidParameter("tensor_parallel_size", f"tensor_parallel_size must be >= 1, got {a.tensor_parallel_size}")
    if not isinstance(a.max_consecutive_step_failures, int) or a.max_consecutive_step_failures < 1:
        raise InvalidParameter("max_consecutive_step_failures", f"max_consecutive_step_failures must be an integer "
                                                                f">= 1, got {a.max_consecutive_step_failures!r}")
    if a.preemption_mode not in ("recompute", "swap"):
        raise InvalidParameter("preemption_mode", f"preemption_mode must be 'recompute' or 'swap', "
                                                  f"got {a.preemption_mode!r}")
    if swap_space_bytes is None:
        swap_space_bytes = DEFAULT_SWAP_SPACE_BYTES if a.preemption_mode == "swap" else 0
    if swap_space_bytes < 0:
        raise InvalidParameter("swap_space_bytes", f"swap_space_bytes must be >= 0, got {swap_space_bytes}")
    model_config = load_model_config(a.model, a.dtype, a.max_model_len)
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if attention_backend is None:  # CPU: the compiled ops when they build/load, else torch (one log line)
        from kvserve.runtime.models.attention import default_cpu_backend

        attention_backend = "triton" if device.startswith("cuda") else default_cpu_backend()
    if max_num_batched_tokens is None:
        max_num_batched_tokens = 2048 if a.enable_chunked_prefill else model_config.max_model_len
    if kv_cache_bytes is None and a.num_kv_blocks is None and device == "cpu":
        kv_cache_bytes = DEFAULT_CPU_KV_CACHE_BYTES
    try:
        scheduler = SchedulerConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                    max_model_len=model_config.max_model_len,
                                    enable_chunked_prefill=a.enable_chunked_prefill,
                                    long_prefill_token_threshold=a.long_prefill_token_threshold,
                                    preemption_mode=a.preemption_mode)
    except ValueError as exc:
        field_name = str(exc).split(" ", 1)[0].replace("with", "max_num_batched_tokens")
        raise InvalidParameter(field_name, str(exc)) from None
    if a.load_format not in ("auto", "dummy"):
        raise InvalidParameter("load_format", f"load_format must be 'auto' or 'dummy', got {a.load_format!r}")
    cuda_graph_sizes = _cuda_graph_sizes(a, model_config, device, attention_backend)
    cache = CacheConfig(block_size=a.block_size, enable_prefix_caching=a.enable_prefix_caching,
                        kv_cache_bytes=kv_cache_bytes, num_kv_blocks=a.num_kv_blocks,
                        gpu_memory_utilization=a.gpu_memory_utilization, kv_cache_dtype=kv_cache_dtype,
                        swap_space_bytes=swap_space_bytes)
    return EngineConfig(model=model_config, cache=cache, scheduler=scheduler,
                        tensor_parallel_size=a.tensor_parallel_size, attention_backend=attention_backend,
                        device=device, seed=a.seed, max_consecutive_step_failures=a.max_consecutive_step_failures,
                        load_format=a.load_format, cuda_graph_sizes=cuda_graph_sizes)


def _cuda_graph_sizes(a, model_config: ModelConfig, device: str, attention_backend: str) -> tuple[int, ...]:
    """--cuda-graphs / --cuda-graph-sizes -> the sorted batch sizes to capture (empty: graphs off)."""
    if not a.cuda_graphs:
        if a.cuda_graph_sizes:
            raise InvalidParameter("cuda_graph_sizes", "cuda_graph_sizes is set but cuda_graphs is off "
                                                       "(add --cuda-graphs)")
        return ()
    from kvserve.runtime.models.registry import moe_shape
    from kvserve.runtime.worker import cuda_graphs

    moe = moe_shape(model_config.hf_config)
    reason = cuda_graphs.unsupported_reason(
        device=device, attention_backend=attention_backend, tensor_parallel_size=a.tensor_parallel_size,
        num_kv_groups=len(capacity.shape_kv_cache_groups(model_config.shape)),
        moe=bool(moe is not None and moe.sparse_layers))
    if reason:
        raise InvalidParameter("cuda_graphs", reason)
    if a.cuda_graph_sizes is None:
        return cuda_graphs.default_capture_sizes(a.max_num_seqs)
    from kvserve.runtime.engine_args import positive_int_list

    text = a.cuda_graph_sizes if isinstance(a.cuda_graph_sizes, str) else ",".join(map(str, a.cuda_graph_sizes))
    try:
        sizes = sorted(set(positive_int_list(text)))
    except ValueError:
        raise InvalidParameter("cuda_graph_sizes", f"cuda_graph_sizes must be comma-separated positive integers, "
                                                   f"got {a.cuda_graph_sizes!r}") from None
    if sizes[-1] > a.max_num_seqs:
        raise InvalidParameter("cuda_graph_sizes", f"cuda_graph_sizes {sizes[-1]} exceeds max_num_seqs "
                                                   f"{a.max_num_seqs} (a decode step never has more sequences)")
    return tuple(sizes)

"""The decode-CUDA-graph settings (--cuda-graphs, --cuda-graph-sizes), checked once when the engine config is
built: which settings graphs support, and the batch sizes to capture. Torch-free, so the config layer never
imports the executor; the capture itself is runtime/executor/cuda_graphs.py."""

from __future__ import annotations

from kvserve.runtime import capacity
from kvserve.runtime.engine_args import positive_int_list
from kvserve.runtime.errors import InvalidParameter

EMULATE_ON_CPU = False  # tests: capture/replay without CUDA (see module docstring)
MAX_DEFAULT_CAPTURE_SIZE = 512


def default_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's ladder: 1, 2, 4, then every multiple of 8, up to max_num_seqs (at most 512)."""
    limit = min(max_num_seqs, MAX_DEFAULT_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s <= limit] + list(range(8, limit + 1, 8))
    if limit not in sizes:  # max_num_seqs itself, so that a full batch never falls back to eager
        sizes.append(limit)
    return tuple(sorted(sizes))


def unsupported_reason(
    *, device: str, attention_backend: str, tensor_parallel_size: int, num_kv_groups: int, moe: bool
) -> str | None:
    """Why decode CUDA graphs cannot run with these settings (None: they can). Checked once, at config time."""
    if not (device.startswith("cuda") or EMULATE_ON_CPU):
        return f"cuda_graphs needs a CUDA device (device is {device!r})"
    if attention_backend != "triton":
        return (
            f"cuda_graphs needs attention_backend 'triton' (got {attention_backend!r}: the torch backend "
            f"reads per-step host lengths, which a graph would freeze)"
        )
    if tensor_parallel_size != 1:
        return f"cuda_graphs supports tensor_parallel_size 1 only (got {tensor_parallel_size})"
    if num_kv_groups > 1:
        return (
            "cuda_graphs does not support sliding-window models (several KV cache groups with their own "
            "per-step block tables)"
        )
    if moe:
        return "cuda_graphs does not support mixture-of-experts models (expert routing counts tokens on the host)"
    return None


def capture_sizes(a, model_config, device: str, attention_backend: str) -> tuple[int, ...]:
    """--cuda-graphs / --cuda-graph-sizes -> the sorted batch sizes to capture (empty: graphs off)."""
    if not a.cuda_graphs:
        if a.cuda_graph_sizes:
            raise InvalidParameter(
                "cuda_graph_sizes", "cuda_graph_sizes is set but cuda_graphs is off (add --cuda-graphs)"
            )
        return ()
    shape = model_config.shape
    reason = unsupported_reason(
        device=device,
        attention_backend=attention_backend,
        tensor_parallel_size=a.tensor_parallel_size,
        num_kv_groups=len(capacity.shape_kv_cache_groups(shape)),
        moe=shape.num_experts > 0 and shape.num_dense_layers < shape.num_layers,
    )
    if reason:
        raise InvalidParameter("cuda_graphs", reason)
    if a.cuda_graph_sizes is None:
        return default_capture_sizes(a.max_num_seqs)
    text = a.cuda_graph_sizes if isinstance(a.cuda_graph_sizes, str) else ",".join(map(str, a.cuda_graph_sizes))
    try:
        sizes = sorted(set(positive_int_list(text)))
    except ValueError:
        raise InvalidParameter(
            "cuda_graph_sizes",
            f"cuda_graph_sizes must be comma-separated positive integers, got {a.cuda_graph_sizes!r}",
        ) from None
    if sizes[-1] > a.max_num_seqs:
        raise InvalidParameter(
            "cuda_graph_sizes",
            f"cuda_graph_sizes {sizes[-1]} exceeds max_num_seqs "
            f"{a.max_num_seqs} (a decode step never has more sequences)",
        )
    return tuple(sizes)

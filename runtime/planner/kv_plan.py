"""KV-cache capacity planner: pure arithmetic from a model's shape and a GPU's memory.

Per GPU rank with tensor parallelism t (the same budget the runtime enforces with `--kv-cache-bytes`):

    budget   = gpu_memory * gpu_memory_utilization
    kv_cache = budget - weights / t - activation_reserve - runtime_overhead - lora_slots
                                                                                (floored to whole blocks)

KV heads are split across ranks (replicated when t > kv_heads), so one token costs
`2 * layers * kv_heads_per_rank * head_dim * kv_dtype_bytes` on each rank and every rank holds the same tokens.
Sliding-window models (Gemma 2/3) are charged per KV cache group (capacity.KVLayout.blocks_per_sequence):
global layers for the whole context, sliding layers for window - 1 + one step's tokens + 1 block, which is
what the runtime's KV manager keeps (it frees the rest); the plan also reports what a full-context charge
of every layer would give (max_concurrency_full_context), so the saving is visible.
The activation reserve is estimated from the shape (see `activation_reserve_bytes`); the non-torch overhead
is llm-d's constant (config_explorer/capacity_planner.py: 0.15 GiB at TP=1, 0.6 GiB at TP>=2). llm-d uses a flat
~4.8 GiB activation constant for Llama-family models; that is more conservative than the estimate here for
small models (Llama-3-8B on a 24 GB L4 would get almost no KV), so it is offered as an override instead:
both numbers can be set per InferenceService (engine.activationReserveMiB, engine.runtimeOverheadMiB).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from kvserve.runtime import capacity, engine_args
from kvserve.runtime.planner.catalog import GiB, ModelShape

FIXED_RESERVE_BYTES = 1 * GiB  # CUDA graphs, NCCL buffers, allocator fragmentation
RUNTIME_OVERHEAD_TP1_BYTES = int(0.15 * GiB)
RUNTIME_OVERHEAD_TP_BYTES = int(0.6 * GiB)
_DEFAULTS = engine_args.crd_defaults()


@dataclass(frozen=True)
class PlanInput:
    model: ModelShape
    gpu_memory_bytes: int
    # The operator's defaults (engine_args.crd_defaults: EngineArgs, the one definition).
    tensor_parallel_size: int = _DEFAULTS["gpu.tensorParallelSize"]
    dtype: str = _DEFAULTS["model.dtype"]  # weights
    kv_cache_dtype: str = _DEFAULTS["engine.kvCacheDtype"]  # "auto" = same as the weights
    max_model_len: int = _DEFAULTS["engine.maxModelLen"]
    block_size: int = _DEFAULTS["engine.blockSize"]
    gpu_memory_utilization: float = _DEFAULTS["engine.gpuMemoryUtilization"]
    max_num_batched_tokens: int = _DEFAULTS["engine.maxNumBatchedTokens"]
    max_num_seqs: int = _DEFAULTS["engine.maxNumSeqs"]
    activation_reserve_bytes: int | None = None  # None: `activation_reserve_bytes()` estimate
    runtime_overhead_bytes: int | None = None  # None: llm-d's non-torch constant for the TP size
    # issue 28: stages of layers; world = TP x PP GPUs per replica (EngineArgs' default: the one definition)
    pipeline_parallel_size: int = engine_args.default("pipeline_parallel_size")
    # --enable-lora: adapter slots resident on each GPU (0: LoRA off) and their padded rank (issue 24)
    max_loras: int = 0
    max_lora_rank: int = engine_args.default("max_lora_rank")


@dataclass(frozen=True)
class Plan:
    fits: bool
    reason: str  # CamelCase condition reason: Fits, WeightsDoNotFit, ContextDoesNotFit, ...
    message: str
    kv_bytes_per_token: int  # whole model, all ranks together
    kv_bytes_per_token_per_gpu: int
    weight_bytes: int
    weight_bytes_per_gpu: int
    gpu_memory_bytes: int
    memory_budget_bytes_per_gpu: int  # gpu_memory * utilization
    activation_reserve_bytes: int
    runtime_overhead_bytes: int
    kv_cache_bytes_per_gpu: int  # what `--kv-cache-bytes` receives: whole blocks only, 0 when nothing fits
    num_blocks_per_gpu: int
    kv_tokens: int  # tokens one replica can hold (every rank holds its slice of the same tokens)
    max_concurrency: int  # sequences of max_model_len tokens that fit at once
    max_model_len_fit: int  # the longest single sequence that fits (capped at the model's positions)
    max_model_len: int
    block_size: int
    tensor_parallel_size: int
    # Sliding-window models: 0 / what charging every layer for the full context would allow instead.
    sliding_window: int = 0
    num_kv_cache_groups: int = 1
    pipeline_parallel_size: int = engine_args.default("pipeline_parallel_size")
    kv_bytes_per_block_per_gpu: int = 0  # one block id: block_size tokens of one group's layers
    max_concurrency_full_context: int = 0
    max_model_len_fit_full_context: int = 0
    lora_slot_bytes_per_gpu: int = 0  # --max-loras adapter slots (capacity.lora_slot_bytes_per_rank)

    def to_dict(self) -> dict:
        return asdict(self)


def kv_heads_per_rank(model: ModelShape, tensor_parallel_size: int) -> int:
    return capacity.kv_heads_per_rank(model.num_kv_heads, tensor_parallel_size)


def tensor_parallel_error(model: ModelShape, tensor_parallel_size: int) -> str | None:
    return capacity.shape_tp_error(model, tensor_parallel_size)


def valid_tensor_parallel_sizes(model: ModelShape, limit: int = 8) -> list[int]:
    return capacity.valid_tp_sizes(model.num_attention_heads, model.num_kv_heads, model.intermediate_size, limit)


def activation_reserve_bytes(
    model: ModelShape,
    tensor_parallel_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    act_dtype_bytes: int = 2,
) -> int:  # noqa: D417
    """Peak forward-pass memory per rank for one step of `max_num_batched_tokens` tokens.

    Per token: ~6 hidden-size buffers (residual, norm output, attention output, q/k/v slices) plus the MLP's
    gate+up intermediate (split by TP; top-k experts for MoE); plus fp32 logits for every running sequence
    (the vocab is gathered before sampling) and a fixed 1 GiB for CUDA graphs / NCCL / fragmentation.
    """
    per_token = 6 * model.hidden_size + 2 * model.intermediate_size * model.experts_per_token // tensor_parallel_size
    logits = max_num_seqs * model.vocab_size * 4
    return max_num_batched_tokens * per_token * act_dtype_bytes + logits + FIXED_RESERVE_BYTES


def plan(inp: PlanInput) -> Plan:
    """Every number comes from kvserve.runtime.capacity, the module the pod sizes its KV cache with; the
    pod receives kv_cache_bytes_per_gpu as --kv-cache-bytes and ends up with exactly num_blocks_per_gpu
    blocks, of which kv_tokens / block_size are usable (block 0 is the null block)."""
    m, t = inp.model, inp.tensor_parallel_size
    layout = capacity.kv_layout(m, inp.dtype, inp.kv_cache_dtype, inp.block_size, t)
    weight_bytes = capacity.weight_bytes_per_rank(m, inp.dtype, 1)
    weight_bytes_per_gpu = capacity.weight_bytes_per_rank(m, inp.dtype, t) if t >= 1 else weight_bytes
    pp = inp.pipeline_parallel_size
    whole_model_layout = layout
    if pp > 1 and t >= 1:
        # Conservative: the heaviest stage's weights and the stage with most layers' KV (with the balanced
        # split these are the first/last stages, within one layer), so every stage fits what is planned.
        ranges = capacity.stage_layer_ranges(m.num_layers, pp)
        weight_bytes_per_gpu = max(
            capacity.stage_weight_bytes_per_rank(m, inp.dtype, t, r, s == 0, s == pp - 1) for s, r in enumerate(ranges)
        )
        widest = max(ranges, key=len)
        layout = capacity.kv_layout(capacity.stage_shape(m, widest), inp.dtype, inp.kv_cache_dtype, inp.block_size, t)
    budget = int(inp.gpu_memory_bytes * inp.gpu_memory_utilization)
    activation = inp.activation_reserve_bytes
    if activation is None:
        activation = activation_reserve_bytes(
            m,
            max(t, 1),
            inp.max_num_batched_tokens,
            inp.max_num_seqs,
            capacity.dtype_bytes(capacity.activation_dtype(inp.dtype)),
        )
    overhead = inp.runtime_overhead_bytes
    if overhead is None:
        overhead = RUNTIME_OVERHEAD_TP1_BYTES if t == 1 else RUNTIME_OVERHEAD_TP_BYTES
    lora_slots = capacity.lora_slot_bytes_per_rank(m, inp.max_loras, inp.max_lora_rank, inp.dtype, max(t, 1))
    free_bytes = budget - weight_bytes_per_gpu - activation - overhead - lora_slots
    num_blocks = layout.blocks_for_budget(max(free_bytes, 0))
    kv_tokens = layout.usable_tokens(num_blocks)
    step = inp.max_num_batched_tokens
    max_concurrency = layout.max_concurrency(num_blocks, inp.max_model_len, step)
    limit = m.max_position_embeddings
    max_model_len_fit = layout.longest_sequence(num_blocks, limit, step)
    # The same bytes charged as if every layer kept the whole context (one group of all layers).
    full = capacity.KVLayout(
        layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.kv_dtype, layout.block_size, t
    )
    full_blocks = full.blocks_for_budget(layout.budget_for_blocks(num_blocks))
    sliding = dict(
        sliding_window=m.sliding_window if layout.num_groups > 1 else 0,
        num_kv_cache_groups=layout.num_groups,
        kv_bytes_per_block_per_gpu=layout.bytes_per_block,
        max_concurrency_full_context=full.max_concurrency(full_blocks, inp.max_model_len),
        max_model_len_fit_full_context=full.longest_sequence(full_blocks, limit),
    )
    common = dict(
        kv_bytes_per_token=whole_model_layout.bytes_per_token,
        kv_bytes_per_token_per_gpu=layout.bytes_per_token_per_rank,
        weight_bytes=weight_bytes,
        weight_bytes_per_gpu=weight_bytes_per_gpu,
        gpu_memory_bytes=inp.gpu_memory_bytes,
        memory_budget_bytes_per_gpu=budget,
        activation_reserve_bytes=activation,
        runtime_overhead_bytes=overhead,
        kv_cache_bytes_per_gpu=layout.budget_for_blocks(num_blocks),
        num_blocks_per_gpu=num_blocks,
        kv_tokens=kv_tokens,
        max_concurrency=max_concurrency,
        max_model_len_fit=max_model_len_fit,
        max_model_len=inp.max_model_len,
        block_size=inp.block_size,
        tensor_parallel_size=t,
        pipeline_parallel_size=pp,
        lora_slot_bytes_per_gpu=lora_slots,
        **sliding,
    )

    arch_error = capacity.unsupported_architecture_error(m)
    if arch_error:
        return Plan(False, "UnsupportedArchitecture", arch_error, **common)
    tp_error = tensor_parallel_error(m, t)
    if tp_error:
        return Plan(False, "InvalidTensorParallelSize", tp_error, **common)
    if inp.max_model_len > m.max_position_embeddings:
        return Plan(
            False,
            "ContextExceedsModel",
            f"maxModelLen {inp.max_model_len} exceeds the model's {m.max_position_embeddings} positions",
            **common,
        )
    if free_bytes <= 0:
        fixed = weight_bytes_per_gpu + activation + overhead + lora_slots
        return Plan(
            False,
            "WeightsDoNotFit",
            f"weights {_gb(weight_bytes_per_gpu)} + activations {_gb(activation)} + overhead "
            f"{_gb(overhead)}"
            + (f" + LoRA slots {_gb(lora_slots)}" if lora_slots else "")
            + f" = {_gb(fixed)} per GPU exceed the {_gb(budget)} budget "
            f"({inp.gpu_memory_utilization:g} x {_gb(inp.gpu_memory_bytes)}) at tensorParallelSize {t}"
            + (f" x pipelineParallelSize {pp}" if pp > 1 else ""),
            **common,
        )
    context_error = capacity.one_sequence_error(num_blocks, inp.max_model_len, layout, "kv_cache_bytes", step)
    if context_error:
        return Plan(False, "ContextDoesNotFit", context_error, **common)
    saving = ""
    if layout.num_groups > 1:
        saving = (
            f" (sliding window {m.sliding_window} on {m.num_sliding_layers} of {m.num_layers} layers; "
            f"{sliding['max_concurrency_full_context']} if every layer kept the full context)"
        )
    return Plan(
        True,
        "Fits",
        f"{kv_tokens} KV tokens per replica ({num_blocks} blocks of {inp.block_size} per GPU incl. the null "
        f"block, {_gb(layout.budget_for_blocks(num_blocks))}); {max_concurrency} concurrent "
        f"{inp.max_model_len}-token sequences{saving}"
        + (f"; {pp} pipeline stages x TP {t} = {pp * t} GPUs, the fullest stage decides" if pp > 1 else ""),
        **common,
    )


def plan_multinode(inp: PlanInput, gpus_per_node: int, max_nodes: int = 8) -> tuple[Plan, str]:
    """Issue 28: the plan at the given TP first; when it does not fit one node, TP = gpus_per_node (NVLink
    within a node) and the fewest pipeline stages (one node each) that fit. Returns (plan, why)."""
    first = plan(inp)
    if first.fits or first.reason not in ("WeightsDoNotFit", "ContextDoesNotFit"):
        return first, f"fits at tensorParallelSize {inp.tensor_parallel_size} on one node"
    t = gpus_per_node
    if tensor_parallel_error(inp.model, t):
        return first, f"does not fit one node and tensorParallelSize {t} is invalid for this model"
    tried = []
    for pp in range(1, max_nodes + 1):
        if pp > inp.model.num_layers:
            break
        candidate = plan(replace(inp, tensor_parallel_size=t, pipeline_parallel_size=pp))
        if candidate.fits:
            return candidate, (
                f"does not fit {gpus_per_node} GPUs of one node ({first.reason}); chose TP {t} within a node "
                f"(all-reduce over NVLink) x PP {pp} across {pp} nodes (activations only cross nodes), the "
                f"fewest stages that fit" + (f" (PP {', '.join(tried)} did not)" if tried else "")
            )
        tried.append(str(pp))
    return first, f"does not fit {max_nodes} nodes of {gpus_per_node} GPUs"


def _gb(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.2f} GB"

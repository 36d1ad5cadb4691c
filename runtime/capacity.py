"""KV-cache capacity: the one model of "how much fits" shared by the runtime and the operator.

The runtime's KV sizing (worker/model_runner.py), the operator's planner (operator/planner.py) and the
router's index sizing all call these functions, so a plan the operator accepts is exactly what the pod
allocates. Pure Python, no torch: the operator image imports it without the runtime's dependencies
(tests/test_layering.py checks that with import-linter).

Facts kept here, once:
- the dtype table and its aliases (weights, activations and KV cache): bytes per element, torch names,
  FP8 ranges; the kernels, the executor, the CLIs and the CRD's enums (via engine_args) take them from here;
- the KV layout: bytes per token per tensor-parallel rank and per block;
- blocks and tokens for a byte budget, with block 0 reserved as the null block (block tables are padded
  with it; it never holds a token), so usable blocks = blocks - 1;
- the tensor-parallel shape rules and the exact bytes of weights each rank holds;
- which architectures the runtime serves and how an HF config.json maps to a model shape.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

NULL_BLOCKS = 1  # block 0: padding for block tables, never allocated to a request

# Bytes per element of each canonical dtype name.
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
# Other spellings users and HF configs use. "fp8" is vLLM's: e4m3 for KV caches, e4m3 weights for models.
DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "torch.float32": "float32",
    "bf16": "bfloat16",
    "torch.bfloat16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "torch.float16": "float16",
    "fp8": "fp8_e4m3",
    "fp8_e4m3fn": "fp8_e4m3",
}
# The torch dtype (attribute of the torch module) each canonical name is stored as; the runtime's tensors
# and the kernels' caches take their dtypes from here (getattr(torch, TORCH_DTYPE_NAMES[name])).
TORCH_DTYPE_NAMES: dict[str, str] = {
    "float32": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
# Largest finite magnitude of each FP8 format (torch.finfo(...).max); values beyond it saturate on store.
FP8_MAX: dict[str, float] = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
# The unquantised floating-point dtypes weights and activations run in.
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
# `--dtype`: the weights' storage type. fp8 = online FP8 weight quantisation at load (vLLM's
# `--quantization fp8`): linear-layer weights in e4m3 with one fp32 scale per output channel, everything
# else (embeddings, LM head, norms, biases, MoE router) and all activations in FP8_ACTIVATION_DTYPE.
WEIGHT_DTYPES = ("auto", *FLOAT_DTYPES, "fp8")
FP8_ACTIVATION_DTYPE = "bfloat16"
FP8_SCALE_BYTES = 4  # one fp32 scale per output channel of each quantised linear
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")

# What the runtime's model files implement (runtime/models). The planner refuses anything else.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)  # classes: runtime/models/registry.py
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


class CapacityError(ValueError):
    """A setting outside what the runtime can serve; `field` names it (engine argument / spec field)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def canonical_dtype(name: str) -> str:
    key = str(name).strip().lower()
    key = DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise CapacityError(
            "dtype", f"unknown dtype {name!r}; known: {', '.join(DTYPE_BYTES)} (aliases: {', '.join(DTYPE_ALIASES)})"
        )
    return key


def dtype_bytes(name: str) -> int:
    return DTYPE_BYTES[canonical_dtype(name)]


def weight_dtype(dtype: str) -> str:
    """Canonical `--dtype` value: float32/bfloat16/float16 or "fp8" (quantised weights). "auto" is resolved
    from the model's config by the caller before this is asked."""
    key = str(dtype).strip().lower()
    if key in ("fp8", "fp8_e4m3", "fp8_e4m3fn"):
        return "fp8"
    canonical = DTYPE_ALIASES.get(key, key)
    if canonical not in FLOAT_DTYPES:
        raise CapacityError("dtype", f"dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {dtype!r}")
    return canonical


def activation_dtype(dtype: str) -> str:
    """The dtype activations (and an "auto" KV cache) use for a given `--dtype`."""
    w = weight_dtype(dtype)
    return FP8_ACTIVATION_DTYPE if w == "fp8" else w


def kv_cache_dtype(dtype: str, kv_cache_dtype_name: str = "auto") -> str:
    """Canonical KV element type: the activation dtype for "auto", else an fp8 format."""
    key = str(kv_cache_dtype_name).strip().lower()
    if key == "auto":
        return activation_dtype(dtype)
    if key not in KV_CACHE_DTYPES:
        raise CapacityError(
            "kv_cache_dtype", f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype_name!r}"
        )
    return canonical_dtype(key)


def torch_dtype_name(name: str) -> str:
    """The torch attribute name for a dtype name or alias: "bf16" -> "bfloat16", "fp8" -> "float8_e4m3fn"."""
    return TORCH_DTYPE_NAMES[canonical_dtype(name)]


# -- model shape ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """What capacity depends on. Built from a catalog entry, a spec's overrides or a config.json."""

    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    num_parameters: int  # as published (safetensors index); the planner uses the exact per-rank count
    max_position_embeddings: int
    intermediate_size: int  # MLP width (per expert for MoE)
    vocab_size: int
    experts_per_token: int = 1  # MoE top-k; 1 for dense models
    num_experts: int = 0  # 0: dense MLP
    architecture: str = "LlamaForCausalLM"
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2; Llama's attention_bias)
    o_proj_bias: bool = False  # Llama's attention_bias also biases o_proj (Qwen2's does not)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    # MoE models whose some layers keep a dense MLP (Qwen3-MoE's mlp_only_layers / decoder_sparse_step):
    num_dense_layers: int = 0
    dense_intermediate_size: int = 0
    # Sliding-window attention (Gemma 2/3): num_sliding_layers layers keep only the last sliding_window
    # tokens' KV; the others attend to the full context. 0/0 for full-attention models.
    sliding_window: int = 0
    num_sliding_layers: int = 0
    num_layer_norms: int = 2  # RMSNorms per decoder layer (Gemma's sandwich norms: 4)


def shape_from_hf_config(config: dict) -> ModelShape:
    """An HF config.json (as a dict) -> ModelShape. num_parameters is computed (no safetensors index read)."""
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), archs[0] if archs else "")
    text = config.get("text_config") or config  # multimodal wrappers keep the decoder's fields here
    gemma = arch in GEMMA_ARCHITECTURES
    layer_types = gemma_layer_types(text) if gemma else ()
    num_sliding = sum(t == "sliding_attention" for t in layer_types)
    heads = int(text["num_attention_heads"])
    hidden = int(text["hidden_size"])
    num_experts = int(text.get("num_local_experts") or text.get("num_experts") or 0)
    inter = (
        int(text.get("moe_intermediate_size") or text["intermediate_size"])
        if num_experts
        else int(text["intermediate_size"])
    )
    shape = ModelShape(
        num_layers=int(text["num_hidden_layers"]),
        num_attention_heads=heads,
        num_kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or hidden // heads),
        hidden_size=hidden,
        num_parameters=0,
        max_position_embeddings=int(text.get("max_position_embeddings") or 4096),
        intermediate_size=inter,
        vocab_size=int(text["vocab_size"]),
        experts_per_token=int(text.get("num_experts_per_tok") or 1) if num_experts else 1,
        num_experts=num_experts,
        architecture=arch,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", gemma))),
        attention_bias=arch == "Qwen2ForCausalLM" or bool(text.get("attention_bias", False)),
        o_proj_bias=arch != "Qwen2ForCausalLM" and bool(text.get("attention_bias", False)),
        mlp_bias=bool(text.get("mlp_bias", False)),
        qk_norm=arch.startswith("Qwen3") or arch == "Gemma3ForCausalLM",
        sliding_window=int(text.get("sliding_window") or 0) if num_sliding else 0,
        num_sliding_layers=num_sliding if text.get("sliding_window") else 0,
        num_layer_norms=4 if gemma else 2,
        num_dense_layers=_num_dense_layers(text, num_experts) if num_experts else 0,
        dense_intermediate_size=int(text["intermediate_size"]) if num_experts else 0,
    )
    return ModelShape(**{**shape.__dict__, "num_parameters": parameters_per_rank(shape, 1)})


def gemma_layer_types(text: dict) -> tuple[str, ...]:
    """ "sliding_attention" / "full_attention" per layer, as transformers decides: an explicit layer_types,
    else Gemma 2 slides on even indices (1:1) and Gemma 3 on all but every sliding_window_pattern-th (5:1)."""
    num_layers = int(text["num_hidden_layers"])
    explicit = text.get("layer_types")
    if explicit:
        return tuple(explicit)
    pattern = 2 if text.get("model_type") == "gemma2" else int(text.get("sliding_window_pattern") or 6)
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))


def _num_dense_layers(text: dict, num_experts: int) -> int:
    """transformers' Qwen3-MoE rule (runtime/models/registry.py's moe_shape applies the same): layer i is
    sparse unless listed in mlp_only_layers, and only every decoder_sparse_step-th layer (from 1) is."""
    mlp_only = set(text.get("mlp_only_layers") or [])
    step = int(text.get("decoder_sparse_step") or 1)
    layers = int(text["num_hidden_layers"])
    return sum(1 for i in range(layers) if i in mlp_only or not (num_experts > 0 and (i + 1) % step == 0))


# -- what the runtime serves for a config.json (runtime.engine_args.resolve_for_config: serve and plan) ----
UNSUPPORTED_ROPE_TYPES = ("dynamic", "longrope")  # frequencies change with the running length; one table here


def checkpoint_dtype(config: dict) -> str:
    """What `--dtype auto` loads: the dtype config.json declares (`dtype`; `torch_dtype` in files written
    before transformers 4.56), else float32, transformers' default. As written (weight_dtype canonicalises)."""
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


def _config_architecture(config: dict) -> str:
    archs = config.get("architectures") or []
    return next((a for a in archs if a in SUPPORTED_ARCHITECTURES), "")


def context_limit(config: dict) -> int:
    """The longest max_model_len the runtime serves for this config.json (and its default): the decoder's
    max_position_embeddings (4096 when absent, as shape_from_hf_config), capped at the sliding window for
    models other than Gemma: only Gemma's models implement sliding-window layers (runtime/models/gemma.py),
    the others keep every sequence inside the window, where full attention is exact. use_sliding_window
    defaults as transformers' configs do (False for the Qwen families, which carry the flag)."""
    text = config.get("text_config") or config
    arch = _config_architecture(config)
    limit = int(text.get("max_position_embeddings") or 0) or 4096
    window = text.get("sliding_window")
    if window and text.get("use_sliding_window", not arch.startswith("Qwen")) and arch not in GEMMA_ARCHITECTURES:
        limit = min(limit, int(window))
    return limit


def unsupported_config_error(config: dict, source: str = "config.json") -> str | None:
    """Why the runtime refuses this config.json (its architecture or RoPE type), or None. `source` names the
    file in the message."""
    archs = config.get("architectures") or []
    if not _config_architecture(config):
        return (
            f"unsupported architecture {archs or config.get('model_type')!r} in {source}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    text = config.get("text_config") or config
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in UNSUPPORTED_ROPE_TYPES:
        return f"rope_type {rope_type!r} in {source} is not supported (supported: default, linear, llama3, yarn)"
    return None


def unsupported_architecture_error(shape: ModelShape) -> str | None:
    if shape.architecture in SUPPORTED_ARCHITECTURES:
        return None
    return (
        f"architecture {shape.architecture or 'unknown'!r} is not served by the kvserve runtime; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


# -- tensor parallelism ---------------------------------------------------------------------------------
def tp_shape_error(num_heads: int, num_kv_heads: int, intermediate_size: int, tp_size: int) -> str | None:
    """Why this model cannot be split t ways, or None when it can (see runtime/models/sharding.py for
    the layout these rules protect)."""
    t = tp_size
    if t < 1:
        return f"tensor_parallel_size must be >= 1, got {t}"
    if t == 1:
        return None
    valid = valid_tp_sizes(num_heads, num_kv_heads, intermediate_size)
    if num_heads % t:
        return f"num_attention_heads={num_heads} is not divisible by tensor_parallel_size={t} (valid: {valid})"
    if num_kv_heads % t and t % num_kv_heads:
        return (
            f"num_key_value_heads={num_kv_heads} and tensor_parallel_size={t}: one must divide the other, so "
            f"every rank's query heads share whole KV heads (valid: {valid})"
        )
    if intermediate_size % t:
        return f"intermediate_size={intermediate_size} is not divisible by tensor_parallel_size={t} (valid: {valid})"
    return None


def shape_tp_error(shape: ModelShape, tp_size: int) -> str | None:
    """tp_shape_error for a whole model: the experts' width and, for MoE models with dense layers, theirs."""
    error = tp_shape_error(shape.num_attention_heads, shape.num_kv_heads, shape.intermediate_size, tp_size)
    if error is None and shape.num_dense_layers and shape.dense_intermediate_size % tp_size:
        return (
            f"intermediate_size={shape.dense_intermediate_size} (the dense layers' MLP) is not divisible by "
            f"tensor_parallel_size={tp_size}"
        )
    return error


def valid_tp_sizes(num_heads: int, num_kv_heads: int, intermediate_size: int, limit: int = 8) -> list[int]:
    return [
        t
        for t in range(1, min(limit, num_heads) + 1)
        if num_heads % t == 0 and intermediate_size % t == 0 and (num_kv_heads % t == 0 or t % num_kv_heads == 0)
    ]


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """Split when divisible, else one replicated head per rank (t a multiple of num_kv_heads)."""
    return num_kv_heads // tp_size if num_kv_heads % tp_size == 0 else 1


def parameters_per_rank(shape: ModelShape, tp_size: int) -> int:
    """Elements one rank allocates, as the runtime's tensor-parallel layers shard them. Returns the total;
    `parameter_groups_per_rank` gives the split into quantisable linear weights and the rest."""
    linear, other, _ = parameter_groups_per_rank(shape, tp_size)
    return linear + other


def parameter_groups_per_rank(shape: ModelShape, tp_size: int) -> tuple[int, int, int]:
    """(linear weight elements, other elements, linear output channels) on one rank. Linear weights are
    what fp8 quantises (one scale per output channel); "other" is embeddings, LM head, norms, biases and the
    MoE router, kept in the activation dtype."""
    t, m = tp_size, shape
    heads = m.num_attention_heads // t
    kv = kv_heads_per_rank(m.num_kv_heads, t)
    inter = m.intermediate_size // t
    vocab_rows = math.ceil(m.vocab_size / t)  # vocab-parallel, padded to a multiple of t
    q_out, kv_out = heads * m.head_dim, kv * m.head_dim
    attn_linear = (q_out + 2 * kv_out) * m.hidden_size + m.hidden_size * q_out
    attn_channels = q_out + 2 * kv_out + m.hidden_size
    # Row-parallel biases (o_proj, down_proj) are whole on every rank: added once after the all-reduce.
    attn_other = (
        m.num_layer_norms * m.hidden_size
        + (q_out + 2 * kv_out if m.attention_bias else 0)
        + (m.hidden_size if m.o_proj_bias else 0)
        + (2 * m.head_dim if m.qk_norm else 0)
    )
    experts = max(m.num_experts, 1)
    mlp_linear = experts * 3 * m.hidden_size * inter  # gate, up, down per expert
    mlp_other = experts * (2 * inter + m.hidden_size) if m.mlp_bias else 0
    mlp_channels = experts * (2 * inter + m.hidden_size)
    router = m.hidden_size * m.num_experts  # replicated on every rank
    embeddings = vocab_rows * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    sparse_layers = m.num_layers - m.num_dense_layers  # all of them for dense models (one "expert")
    dense_inter = m.dense_intermediate_size // t
    linear = (
        m.num_layers * attn_linear + sparse_layers * mlp_linear + m.num_dense_layers * 3 * m.hidden_size * dense_inter
    )
    other = m.num_layers * attn_other + sparse_layers * (mlp_other + router) + embeddings + m.hidden_size  # + norm
    channels = (
        m.num_layers * attn_channels
        + sparse_layers * mlp_channels
        + m.num_dense_layers * (2 * dense_inter + m.hidden_size)
    )
    return linear, other, channels


def weight_bytes_per_rank(shape: ModelShape, dtype: str, tp_size: int) -> int:
    """Bytes of weights one rank allocates for `--dtype dtype` (fp8: 1-byte linears + fp32 scales)."""
    linear, other, channels = parameter_groups_per_rank(shape, tp_size)
    w = weight_dtype(dtype)
    if w == "fp8":
        return linear * 1 + channels * FP8_SCALE_BYTES + other * DTYPE_BYTES[FP8_ACTIVATION_DTYPE]
    return (linear + other) * DTYPE_BYTES[w]


# -- KV cache groups (sliding-window models) -----------------------------------------------------------
@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table (vLLM's KV cache group). sliding_window 0: full attention."""

    sliding_window: int
    layers: tuple[int, ...]  # model layer indices; a bucket's last group may hold fewer than layers_per_group


def layer_windows(layer_types, sliding_window: int) -> tuple[int, ...]:
    return tuple(sliding_window if t == "sliding_attention" and sliding_window else 0 for t in layer_types)


def kv_cache_groups(windows: tuple[int, ...]) -> tuple[KVCacheGroup, ...]:
    """Split layers into groups of equal size g, one group per block table, all drawing block ids from one
    pool (vLLM's hybrid KV cache manager). A block id then always buys g layers x block_size tokens,
    whichever group holds it, so the pool needs no per-group split. g = the smaller of the full and the
    sliding layer counts (Gemma 2: two groups of N/2; Gemma-3-1B: 4 full + 22 sliding -> 1 full group and 6
    sliding ones, 2 slots unused). Models without both kinds keep one group of every layer (no freeing)."""
    full = tuple(i for i, w in enumerate(windows) if not w)
    sliding: dict[int, list[int]] = {}
    for i, w in enumerate(windows):
        if w:
            sliding.setdefault(w, []).append(i)
    if not full or not sliding:
        return (KVCacheGroup(0, tuple(range(len(windows)))),)
    g = min(len(full), *(len(v) for v in sliding.values()))
    groups = [KVCacheGroup(0, full[i : i + g]) for i in range(0, len(full), g)]
    for w, layers in sliding.items():
        groups += [KVCacheGroup(w, tuple(layers[i : i + g])) for i in range(0, len(layers), g)]
    return tuple(groups)


def layer_group_index(groups: tuple[KVCacheGroup, ...]) -> dict[int, tuple[int, int]]:
    """layer -> (group, slot): the slot is which of the g per-slot KV tensors the layer uses."""
    return {layer: (gi, slot) for gi, g in enumerate(groups) for slot, layer in enumerate(g.layers)}


def shape_kv_cache_groups(shape: ModelShape) -> tuple[KVCacheGroup, ...]:
    """The grouping from the shape's counts (which layer is which does not change the sizes)."""
    num_sliding = shape.num_sliding_layers if shape.sliding_window else 0
    return kv_cache_groups((shape.sliding_window,) * num_sliding + (0,) * (shape.num_layers - num_sliding))


# -- KV layout and budgets --------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVLayout:
    """One rank's KV cache geometry. Every rank holds its KV heads' slice of the same tokens.
    group_windows: one entry per KV cache group (0 = full attention); empty = one group of every layer."""

    num_layers: int
    num_kv_heads: int  # whole model
    head_dim: int
    kv_dtype: str  # canonical (see kv_cache_dtype())
    block_size: int
    tensor_parallel_size: int = 1
    group_windows: tuple[int, ...] = ()
    layers_per_group: int = 0  # 0: num_layers

    @property
    def kv_heads_per_rank(self) -> int:
        return kv_heads_per_rank(self.num_kv_heads, self.tensor_parallel_size)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows) or 1

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer, whole model (all ranks together): the full-context charge."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.kv_dtype]

    @property
    def bytes_per_token_per_rank(self) -> int:
        return 2 * self.num_layers * self.kv_heads_per_rank * self.head_dim * DTYPE_BYTES[self.kv_dtype]

    @property
    def bytes_per_block(self) -> int:
        """One block id: block_size tokens of one group's layers (padding slots of a short group included)."""
        layers = self.layers_per_group or self.num_layers
        return self.block_size * 2 * layers * self.kv_heads_per_rank * self.head_dim * DTYPE_BYTES[self.kv_dtype]

    def blocks_for_budget(self, kv_cache_bytes: int) -> int:
        """Physical blocks a per-rank byte budget buys (the null block is one of them)."""
        return max(0, int(kv_cache_bytes) // self.bytes_per_block)

    def budget_for_blocks(self, num_blocks: int) -> int:
        return num_blocks * self.bytes_per_block

    def blocks_per_sequence(self, num_tokens: int, max_num_batched_tokens: int | None = None) -> int:
        """Blocks one sequence of num_tokens holds at its peak, over all groups. A sliding group holds the
        window's W - 1 earlier tokens plus one step's new ones (at most max_num_batched_tokens; None: the
        whole sequence in one step), +1 block because the window rarely starts on a block boundary
        (vLLM's SlidingWindowSpec charge); the KV manager frees the rest (core/kv_cache_manager.py)."""
        full = blocks_per_sequence(num_tokens, self.block_size)
        step = num_tokens if max_num_batched_tokens is None else max_num_batched_tokens
        total = 0
        for w in self.group_windows or (0,):
            total += (
                full if not w else min(full, blocks_per_sequence(min(w - 1 + step, num_tokens), self.block_size) + 1)
            )
        return total

    def usable_tokens(self, num_blocks: int) -> int:
        """Tokens of context the cache holds with every group holding all of them (the full-context view:
        kvTokens and the kv_capacity gauge); sliding groups make sequences cheaper than that (max_concurrency)."""
        return usable_tokens(num_blocks, self.block_size, self.num_groups)

    def max_concurrency(self, num_blocks: int, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
        return usable_blocks(num_blocks) // self.blocks_per_sequence(max_model_len, max_num_batched_tokens)

    def longest_sequence(self, num_blocks: int, limit: int, max_num_batched_tokens: int | None = None) -> int:
        """The longest single sequence (<= limit tokens) that fits in num_blocks."""
        usable = usable_blocks(num_blocks)
        lo, hi = 0, limit
        while lo < hi:  # blocks_per_sequence grows with the length
            mid = (lo + hi + 1) // 2
            if self.blocks_per_sequence(mid, max_num_batched_tokens) <= usable:
                lo = mid
            else:
                hi = mid - 1
        return lo


def kv_layout(shape: ModelShape, dtype: str, kv_cache_dtype_name: str, block_size: int, tp_size: int) -> KVLayout:
    groups = shape_kv_cache_groups(shape)
    windows = tuple(g.sliding_window for g in groups) if len(groups) > 1 else ()
    return KVLayout(
        shape.num_layers,
        shape.num_kv_heads,
        shape.head_dim,
        kv_cache_dtype(dtype, kv_cache_dtype_name),
        block_size,
        tp_size,
        group_windows=windows,
        layers_per_group=len(groups[0].layers) if windows else 0,
    )


def usable_blocks(num_blocks: int) -> int:
    return max(0, num_blocks - NULL_BLOCKS)


def usable_tokens(num_blocks: int, block_size: int, num_groups: int = 1) -> int:
    """Tokens the KV cache can hold: the `kvserve:kv_capacity_tokens` gauge and the plan's kvTokens. With
    several KV cache groups (sliding-window models) every group holds each token of a full-context sequence."""
    return usable_blocks(num_blocks) // num_groups * block_size


def blocks_per_sequence(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def max_concurrency(num_blocks: int, max_model_len: int, block_size: int) -> int:
    """Sequences of max_model_len tokens that fit at once (single-group layouts; see KVLayout.max_concurrency)."""
    return usable_blocks(num_blocks) // blocks_per_sequence(max_model_len, block_size)


def one_sequence_error(
    num_blocks: int, max_model_len: int, layout: KVLayout, source: str, max_num_batched_tokens: int | None = None
) -> str | None:
    """The refusal both sides give when one max_model_len sequence cannot fit (None when it fits).
    `source` names the setting that decided the budget (kv_cache_bytes, num_kv_blocks, ...)."""
    usable = usable_blocks(num_blocks)
    needed = layout.blocks_per_sequence(max_model_len, max_num_batched_tokens)
    if usable >= needed:
        return None
    longest = layout.longest_sequence(num_blocks, max_model_len, max_num_batched_tokens)
    held = (
        f"{usable * layout.block_size} tokens"
        if layout.num_groups == 1
        else f"shared by {layout.num_groups} KV cache groups"
    )
    return (
        f"{source}: the KV cache holds {usable} usable blocks of {layout.block_size} tokens "
        f"({held}) per rank, but one max_model_len={max_model_len} sequence needs "
        f"{needed} blocks ({layout.budget_for_blocks(needed + NULL_BLOCKS)} bytes with the null block); "
        f"raise the KV budget or set max_model_len <= {longest}"
    )


# Architectures whose model class has the Llama layout a pipeline stage is cut from (models/pipeline_stage.py);
# the runtime refuses PP for others (config.py) and the operator never renders a group for them;
# Gemma's sandwich norms and per-layer KV cache groups are not staged yet.
PIPELINE_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
)


# -- Pipeline parallelism (issue 28): which layers each stage owns and what one stage's rank allocates ------
# Layers split by count, earlier stages taking the remainder; `--pipeline-layer-split 31,32,32,31` overrides.
# Stage 0 also holds the embedding, the last stage the final norm and LM head.
def stage_layer_ranges(num_layers: int, pp_size: int, layer_split: tuple[int, ...] = ()) -> tuple[range, ...]:
    """Layer index ranges, one per stage. Raises ValueError naming the setting on bad input."""
    if pp_size < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp_size}")
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp_size} exceeds num_hidden_layers={num_layers}")
    if layer_split:
        if len(layer_split) != pp_size:
            raise ValueError(
                f"pipeline_layer_split has {len(layer_split)} entries but pipeline_parallel_size={pp_size}"
            )
        if any(n < 1 for n in layer_split) or sum(layer_split) != num_layers:
            raise ValueError(
                f"pipeline_layer_split={','.join(map(str, layer_split))} must be positive counts summing to "
                f"num_hidden_layers={num_layers}"
            )
        counts = tuple(layer_split)
    else:
        base, extra = divmod(num_layers, pp_size)
        counts = tuple(base + (1 if s < extra else 0) for s in range(pp_size))
    ranges, start = [], 0
    for n in counts:
        ranges.append(range(start, start + n))
        start += n
    return tuple(ranges)


def stage_shape(shape: ModelShape, layers: range) -> ModelShape:
    """The shape of the decoder layers one stage owns, without vocabulary tensors (added by the caller).
    Dense MLP layers of MoE models are taken as the first layers (DeepSeek's first_k_dense_replace)."""
    dense = max(0, min(shape.num_dense_layers, layers.stop) - layers.start)
    sliding = round(shape.num_sliding_layers * len(layers) / shape.num_layers)
    return dataclasses.replace(
        shape, num_layers=len(layers), num_dense_layers=dense, num_sliding_layers=sliding, vocab_size=0
    )


def stage_weight_bytes_per_rank(
    shape: ModelShape, dtype: str, tp_size: int, layers: range, first: bool, last: bool
) -> int:
    """Weight bytes one rank of one stage allocates: its layers, plus the embedding on the first stage and
    the final norm + LM head on the last (a tied LM head is a second copy there: the stages do not share
    memory). Embedding and head stay in the activation dtype, as in parameter_groups_per_rank."""
    body = weight_bytes_per_rank(stage_shape(shape, layers), dtype, tp_size)
    per_elem = DTYPE_BYTES[activation_dtype(dtype)]
    vocab_rows = -(-shape.vocab_size // tp_size)
    table = vocab_rows * shape.hidden_size * per_elem
    # weight_bytes_per_rank counts the final norm once per call; only the last stage keeps it.
    norm = shape.hidden_size * DTYPE_BYTES[activation_dtype(dtype)]
    return body - (0 if last else norm) + (table if first else 0) + (table if last else 0)


def stage_kv_bytes_per_token_per_rank(
    shape: ModelShape, dtype: str, kv_cache_dtype_name: str, tp_size: int, layers: range
) -> int:
    """KV bytes per token one rank of one stage holds: its own layers only."""
    kv = kv_heads_per_rank(shape.num_kv_heads, tp_size)
    return 2 * len(layers) * kv * shape.head_dim * DTYPE_BYTES[kv_cache_dtype(dtype, kv_cache_dtype_name)]


def kv_tokens_per_rank(
    shape: ModelShape,
    dtype: str,
    kv_cache_dtype_name: str,
    tp_size: int,
    pp_size: int,
    gpu_bytes: int,
    layer_split: tuple[int, ...] = (),
) -> tuple[int, int]:
    """(tokens of KV the group can hold, the stage that decides). Every stage must hold every token of a
    sequence, so the stage with the least room per token (the smallest stage) sets the group's"""
    ranges = stage_layer_ranges(shape.num_layers, pp_size, layer_split)
    best: tuple[int, int] | None = None
    for s, layers in enumerate(ranges):
        weights = stage_weight_bytes_per_rank(shape, dtype, tp_size, layers, s == 0, s == pp_size - 1)
        per_token = stage_kv_bytes_per_token_per_rank(shape, dtype, kv_cache_dtype_name, tp_size, layers)
        tokens = max(0, gpu_bytes - weights) // per_token
        if best is None or tokens < best[0]:
            best = (tokens, s)
    assert best is not None
    return best


def lora_slot_bytes_per_rank(
    shape: ModelShape, max_loras: int, max_lora_rank: int, dtype: str, tp_size: int = 1
) -> int:
    """Device bytes of --max-loras adapter slots on one rank (runtime/lora/batched.LoraSlots), what the
    planner takes off the KV budget: each slot padded to --max-lora-rank, A [rank, in] + B [out, rank] of
    every target module (q/k/v/o/gate/up/down; a sparse MoE layer's experts take no adapter, so only dense
    MLP layers have gate/up/down slots). Column-parallel targets shard B's rows, row-parallel ones A's
    columns; the other factor is whole (runtime/lora/tp_shard.py). The slots are in the activation dtype
    (bf16 under --dtype fp8: the batched delta runs in the activation dtype), which is --dtype otherwise."""
    if max_loras <= 0:
        return 0
    h = shape.hidden_size
    q = shape.num_attention_heads // tp_size * shape.head_dim
    kv = kv_heads_per_rank(shape.num_kv_heads, tp_size) * shape.head_dim
    attention = (h + q) + 2 * (h + kv) + (q + h)  # in + out of q, k, v, o
    if shape.num_experts:
        mlp_layers, inter = shape.num_dense_layers, shape.dense_intermediate_size // tp_size
    else:
        mlp_layers, inter = shape.num_layers, shape.intermediate_size // tp_size
    mlp = 2 * (h + inter) + (inter + h)  # gate, up, down
    per_rank = attention * shape.num_layers + mlp * mlp_layers
    return max_loras * max_lora_rank * per_rank * dtype_bytes(activation_dtype(dtype))

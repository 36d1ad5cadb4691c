"""The dtype vocabulary: canonical names, aliases, bytes per element, torch names, FP8 ranges, and which
names each setting (--dtype, --kv-cache-dtype) accepts. The kernels, the executor, the CLIs and the CRD's
enums (via engine_args) take them from here."""

from __future__ import annotations


class CapacityError(ValueError):
    """A setting outside what the runtime can serve; `field` names it (engine argument / spec field)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


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

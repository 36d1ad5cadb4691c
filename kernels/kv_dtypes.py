"""KV-cache dtype names (``kv_cache_dtype``) and their torch dtypes; imports torch lazily."""

from __future__ import annotations

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")

# Largest finite magnitude of each format (torch.finfo(...).max); values beyond it saturate on store.
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype):
    """The torch dtype of the cache tensors: the model dtype for ``"auto"``, else a float8 type."""
    import torch

    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8_e4m3":
        return torch.float8_e4m3fn
    if kv_cache_dtype == "fp8_e5m2":
        return torch.float8_e5m2
    raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")


def is_fp8(dtype) -> bool:
    import torch

    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def kv_cache_dtype_bytes(kv_cache_dtype: str, model_dtype_bytes: int) -> int:
    """Bytes per cached element: 1 for fp8 (the 2x KV compression vs 16-bit), else the model's."""
    return 1 if kv_cache_dtype.startswith("fp8") else model_dtype_bytes

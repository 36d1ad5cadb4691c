"""KV-cache dtype names (``kv_cache_dtype``) and their torch dtypes; imports torch lazily.

The names, their bytes, torch types and FP8 ranges are runtime/capacity/dtypes.py's table (the one home);
this module only turns them into torch objects.
"""

from __future__ import annotations

from kvserve.runtime.capacity import FP8_MAX, KV_CACHE_DTYPES, canonical_dtype, dtype_bytes, torch_dtype_name

__all__ = ["FP8_MAX", "KV_CACHE_DTYPES", "kv_cache_torch_dtype", "is_fp8", "kv_cache_dtype_bytes"]


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype):
    """The torch dtype of the cache tensors: the model dtype for ``"auto"``, else a float8 type."""
    import torch

    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return getattr(torch, torch_dtype_name(kv_cache_dtype))


def is_fp8(dtype) -> bool:
    import torch

    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def kv_cache_dtype_bytes(kv_cache_dtype: str, model_dtype_bytes: int) -> int:
    """Bytes per cached element: 1 for fp8 (the 2x KV compression vs 16-bit), else the model's."""
    return model_dtype_bytes if kv_cache_dtype == "auto" else dtype_bytes(canonical_dtype(kv_cache_dtype))

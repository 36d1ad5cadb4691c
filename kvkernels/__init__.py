"""Triton kernels for paged-attention serving, each beside a pure-torch reference.

* :func:`store_kv_cache` — write new K/V rows into the paged cache (one program per token, slot -1 skipped,
  optional float8 quantization with per-tensor scales).
* :func:`paged_attention` — causal attention of a mixed decode + prefill/extend batch over the paged cache;
  split-K flash-decoding for decode-only batches, a unified 2D kernel otherwise (see ``attention.py``).
* :func:`store_kv_cache_ref`, :func:`paged_attention_ref` — the references (torch only).

Importing this package never requires torch, triton or a GPU: names resolve lazily on first access, and the
Triton-backed ones raise ``ImportError`` with the reason when triton cannot be imported. On CPU the kernels
run under the Triton interpreter when ``TRITON_INTERPRET=1`` is set at launch time.
"""

from __future__ import annotations

import importlib

from .kv_dtypes import FP8_MAX, KV_CACHE_DTYPES, kv_cache_dtype_bytes, kv_cache_torch_dtype

_TRITON_STATE: dict = {}

_LAZY = {
    "store_kv_cache": "kv_store",
    "paged_attention": "attention",
    "unified_attention": "attention",
    "split_k_decode_attention": "attention",
    "choose_num_segments": "attention",
    "store_kv_cache_ref": "reference",
    "paged_attention_ref": "reference",
    "interpret_enabled": "_triton_utils",
}


def triton_available() -> bool:
    """Whether ``triton`` and ``triton.language`` import (says nothing about a GPU being present)."""
    if "ok" not in _TRITON_STATE:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401

            _TRITON_STATE["ok"], _TRITON_STATE["error"] = True, None
        except Exception as exc:  # ImportError, or a broken install raising something else
            _TRITON_STATE["ok"], _TRITON_STATE["error"] = False, f"{type(exc).__name__}: {exc}"
    return _TRITON_STATE["ok"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if module != "reference" and not triton_available():
        raise ImportError(f"kvserve.kernels.{name} needs triton, which failed to import ({_TRITON_STATE['error']})")
    return getattr(importlib.import_module(f".{module}", __name__), name)


__all__ = [
    "store_kv_cache",
    "paged_attention",
    "unified_attention",
    "split_k_decode_attention",
    "choose_num_segments",
    "store_kv_cache_ref",
    "paged_attention_ref",
    "triton_available",
    "interpret_enabled",
    "KV_CACHE_DTYPES",
    "FP8_MAX",
    "kv_cache_torch_dtype",
    "kv_cache_dtype_bytes",
]

"""Attention backends by name: "torch" (attention.py, pure torch, any device), "triton" (attention_triton.py,
kvserve.kernels' Triton kernels; the CUDA default) and "cpu" (attention_cpu.py, the compiled CPU ops of
kvserve.kernels.cpu_ops; the CPU default when they build and load, config.default_cpu_backend). The backends import
only the metadata
contract from attention.py and never this module, so choosing one is a plain lazy import (no registration
cycle).
"""

from __future__ import annotations

_EXTRA: dict[str, type] = {}  # register_attention_backend (tests wire in reference implementations)


def register_attention_backend(name: str, cls: type) -> None:
    _EXTRA[name] = cls


def get_attention_backend(name: str):
    if name in _EXTRA:
        return _EXTRA[name]()
    if name == "torch":
        from kvserve.runtime.models.attention import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        try:
            from kvserve.runtime.models.attention_triton import TritonAttentionBackend
        except ImportError as exc:
            raise ValueError(f"attention_backend 'triton' is unavailable: {exc}") from None
        return TritonAttentionBackend()
    if name == "cpu":
        try:
            from kvserve.runtime.models.attention_cpu import CpuAttentionBackend
        except ImportError as exc:
            raise ValueError(f"attention_backend 'cpu' is unavailable: {exc}") from None
        return CpuAttentionBackend()
    raise ValueError(f"attention_backend must be one of {sorted({'cpu', 'torch', 'triton', *_EXTRA})}, got {name!r}")

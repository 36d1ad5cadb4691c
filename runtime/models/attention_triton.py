"""The "triton" attention backend: kvserve.kernels' KV store + paged attention (the CUDA default).

Same contract as TorchAttentionBackend (see attention.py): store this step's K/V at ``slot_mapping``
(slot -1 skipped inside the kernel), then attend over the whole context through the block tables. FP8
caches use ``meta.k_scale`` / ``meta.v_scale``. On CPU tensors the kernels run only under the Triton
interpreter (``TRITON_INTERPRET=1``), which is how the backend is checked end to end without a GPU.
Importing this module raises ImportError when triton is unusable, which attention_backends.get_attention_backend
turns into a clear ValueError.
"""

from __future__ import annotations

import torch

import kvserve.kernels as _kernels
from kvserve.runtime.models.attention import AttentionMetadata

if not _kernels.triton_available():
    raise ImportError(f"triton is not importable ({_kernels._TRITON_STATE.get('error')})")

from kvserve.kernels import paged_attention, store_kv_cache  # noqa: E402


class TritonAttentionBackend:
    name = "triton"

    def __init__(self) -> None:
        self._scales: dict = {}  # (value, device) -> 1-element fp32 tensor, so fp8 steps do no H2D copies

    def _scale(self, value: float, device: torch.device) -> torch.Tensor:
        key = (float(value), str(device))
        t = self._scales.get(key)
        if t is None:
            t = self._scales[key] = torch.tensor([float(value)], dtype=torch.float32, device=device)
        return t

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        fp8 = k_cache.element_size() == 1
        k = k if k.stride(-1) == 1 else k.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
        if not fp8 and k.dtype != k_cache.dtype:
            k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
        store_kv_cache(
            k,
            v,
            k_cache,
            v_cache,
            meta.slot_mapping,
            self._scale(meta.k_scale, k.device) if fp8 else None,
            self._scale(meta.v_scale, k.device) if fp8 else None,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        self.store_kv(k, v, k_cache, v_cache, meta)
        fp8 = k_cache.element_size() == 1
        q = q if q.stride(-1) == 1 else q.contiguous()
        return paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.cu_seqlens_q,
            meta.max_seqlen_q,
            meta.max_seqlen_k,
            scale,
            self._scale(meta.k_scale, q.device) if fp8 else None,
            self._scale(meta.v_scale, q.device) if fp8 else None,
            sliding_window=sliding_window,
            softcap=softcap,
        )

"""KV-cache store: one Triton program per new token writes its K and V rows into the paged cache.

``slot_mapping[t]`` is the physical slot (``block_id * block_size + offset``) of token ``t``; ``-1`` marks a
padding token that must not be stored. For float8 caches the kernel divides by the per-tensor scale,
saturates to the format's finite range and casts (round to nearest even), exactly as
:func:`kvserve.kernels.reference.quantize_to_cache` does.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._triton_utils import check_device, lazy_jit, next_pow2
from .kv_dtypes import is_fp8


def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_kc_b,
    stride_kc_o,
    stride_kc_h,
    stride_vc_b,
    stride_vc_o,
    stride_vc_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT_BITS: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    src_k = k_ptr + t64 * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :]
    src_v = v_ptr + t64 * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :]
    dst_k = k_cache_ptr + block * stride_kc_b + offset * stride_kc_o + offs_h[:, None] * stride_kc_h + offs_d[None, :]
    dst_v = v_cache_ptr + block * stride_vc_b + offset * stride_vc_o + offs_h[:, None] * stride_vc_h + offs_d[None, :]
    k = tl.load(src_k, mask=mask, other=0.0)
    v = tl.load(src_v, mask=mask, other=0.0)
    if IS_FP8:
        # div_rn: IEEE round-to-nearest division, as torch computes x / scale (Triton's plain fp32 `/`
        # lowers to an approximate division on NVIDIA GPUs, which could flip an fp8 rounding decision).
        k = tl.clamp(tl.math.div_rn(k.to(tl.float32), tl.load(k_scale_ptr)), -FP8_MAX, FP8_MAX)
        v = tl.clamp(tl.math.div_rn(v.to(tl.float32), tl.load(v_scale_ptr)), -FP8_MAX, FP8_MAX)
        if INTERPRET:
            # The triton 3.9 interpreter's fp32->fp8 cast drops the carry when rounding up crosses a power
            # of two (7.8 -> 4.0, not 8.0); values already on the fp8 grid convert exactly, so round first
            # (nearest even, in fp32). The compiled path uses the hardware conversion (cvt.rn.satfinite).
            k_exp = tl.maximum(((k.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, FP8_MIN_EXP)
            k_ulp = ((k_exp - FP8_MANT_BITS + 127) << 23).to(tl.float32, bitcast=True)
            k_r = (tl.abs(k) / k_ulp + 8388608.0) - 8388608.0  # fp32 add rounds to nearest even
            k = tl.where(k < 0, -k_r, k_r) * k_ulp
            v_exp = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, FP8_MIN_EXP)
            v_ulp = ((v_exp - FP8_MANT_BITS + 127) << 23).to(tl.float32, bitcast=True)
            v_r = (tl.abs(v) / v_ulp + 8388608.0) - 8388608.0
            v = tl.where(v < 0, -v_r, v_r) * v_ulp
    tl.store(dst_k, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_v, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


_store_kv = lazy_jit(_store_kv_kernel)

# (mantissa bits, smallest normal exponent) of each float8 format, for the interpreter rounding workaround.
_FP8_FORMAT = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


def scale_tensor(scale, device) -> torch.Tensor:
    """A 1-element float32 tensor on ``device`` from a float, 0-d/1-element tensor or None (-> 1.0)."""
    if scale is None:
        scale = 1.0
    if isinstance(scale, torch.Tensor):
        return scale.reshape(1).to(device=device, dtype=torch.float32)
    return torch.tensor([float(scale)], dtype=torch.float32, device=device)


def store_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Store ``k, v [num_tokens, num_kv_heads, head_dim]`` into ``k_cache, v_cache`` at ``slot_mapping``.

    Caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` (last dim contiguous); float8 caches
    take per-tensor ``k_scale`` / ``v_scale`` (float or 1-element tensor; default 1.0).
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape, (k.shape, v.shape)
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape
    assert slot_mapping.shape[0] >= num_tokens
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    interpret = check_device(k, v, k_cache, v_cache, slot_mapping)
    fp8 = is_fp8(k_cache.dtype)
    assert is_fp8(v_cache.dtype) == fp8
    if fp8:
        ks, vs = scale_tensor(k_scale, k.device), scale_tensor(v_scale, k.device)
        fmax = float(torch.finfo(k_cache.dtype).max)
        mant, min_exp = _FP8_FORMAT[k_cache.dtype]
    else:
        ks = vs = slot_mapping  # unused placeholders (never dereferenced)
        fmax, mant, min_exp = 0.0, 0, 0
    _store_kv[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        ks,
        vs,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=next_pow2(num_kv_heads),
        HEAD_DIM_PAD=next_pow2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        IS_FP8=fp8,
        FP8_MAX=fmax,
        FP8_MANT_BITS=mant,
        FP8_MIN_EXP=min_exp,
        INTERPRET=interpret,
    )


__all__ = ["store_kv_cache", "scale_tensor"]

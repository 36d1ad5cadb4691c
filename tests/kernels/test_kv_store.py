"""store_kv_cache (Triton, interpreter) against store_kv_cache_ref: bit-exact, slot -1 skipped."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import store_kv_cache, store_kv_cache_ref


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _case(gen, num_tokens, num_kv_heads, head_dim, block_size, dtype, cache_dtype):
    num_blocks = num_tokens // block_size + 3
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.25] = -1  # padding rows
    slots[-1] = -1
    # Poison: NaN everywhere, so a write to a wrong slot or a skipped write shows up bit-for-bit.
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan")).to(cache_dtype)
    return k, v, slots, k_cache, k_cache.clone()


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(1, 64, 16), (4, 128, 32), (2, 80, 16), (3, 96, 32)])
def test_store_matches_reference(gen, seed, cache_dtype, num_kv_heads, head_dim, block_size):
    cache_dtype = getattr(torch, cache_dtype)
    fp8 = cache_dtype.itemsize == 1
    dtype = torch.bfloat16 if fp8 or cache_dtype == torch.bfloat16 else torch.float32
    k, v, slots, kc, vc = _case(gen, 45, num_kv_heads, head_dim, block_size, dtype, cache_dtype)
    k_scale, v_scale = (0.013, torch.tensor(0.37)) if fp8 else (None, None)
    if fp8:  # exercise saturation, ties and subnormals of the float8 formats
        k[0, 0, :6] = torch.tensor([1e5, -1e5, 0.101, 7.8 * 0.013, 1e-6, 0.0], dtype=dtype)
    kr, vr = kc.clone(), vc.clone()
    store_kv_cache(k, v, kc, vc, slots, k_scale, v_scale)
    store_kv_cache_ref(k, v, kr, vr, slots, k_scale, v_scale)
    assert torch.equal(_bits(kc), _bits(kr)), f"k cache differs (seed={seed})"
    assert torch.equal(_bits(vc), _bits(vr)), f"v cache differs (seed={seed})"
    # Every stored slot is finite, every other slot still poisoned.
    flat = kc.float().reshape(-1, num_kv_heads, head_dim)
    stored = slots[slots >= 0]
    assert torch.isfinite(flat[stored]).all(), f"seed={seed}"
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[stored] = False
    assert torch.isnan(flat[untouched]).all(), f"a slot-(-1) row or a wrong slot was written (seed={seed})"
    if fp8:  # and dequantizes back to the input within the format's precision (saturated entries aside)
        mant = 3 if cache_dtype == torch.float8_e4m3fn else 2
        deq = flat[slots[1:][slots[1:] >= 0]] * k_scale
        src = k[1:][slots[1:] >= 0].float()
        assert ((deq - src).abs() <= src.abs() * 2.0 ** -(mant + 1) + 2e-3 * k_scale).all(), f"seed={seed}"


def test_store_all_padding_and_empty(gen):
    k, v, slots, kc, vc = _case(gen, 8, 2, 64, 16, torch.float32, torch.float32)
    slots[:] = -1
    store_kv_cache(k, v, kc, vc, slots)
    assert torch.isnan(kc).all() and torch.isnan(vc).all()
    store_kv_cache(k[:0], v[:0], kc, vc, slots[:0])  # zero tokens: no launch, no error


def test_store_strided_inputs(gen, seed):
    """k/v as slices of a fused qkv projection output (row stride > heads * head_dim), as a model produces."""
    qkv = torch.randn(20, 8 + 2 + 2, 64, generator=gen)
    k, v = qkv[:, 8:10], qkv[:, 10:12]
    assert not k.is_contiguous()
    _, _, slots, kc, vc = _case(gen, 20, 2, 64, 16, torch.float32, torch.float32)
    kr, vr = kc.clone(), vc.clone()
    store_kv_cache(k, v, kc, vc, slots)
    store_kv_cache_ref(k, v, kr, vr, slots)
    assert torch.equal(_bits(kc), _bits(kr)) and torch.equal(_bits(vc), _bits(vr)), f"seed={seed}"

"""The "cpu" attention backend: the compiled kvserve CPU ops (kvserve.kernels.cpu_ops), the CPU default.

Same contract as TorchAttentionBackend (see attention.py). Per layer: ``store_kv`` writes this step's K/V
into their slots (slot -1 skipped), then ``paged_attention`` reads every query's context straight from the
paged cache through the block table (no gather): decodes, short extends and prefills over a cached prefix,
mixed in one call, GQA heads of one KV head together. Sequences with more than ``paged_max_q(dtype)`` new
tokens are long prefills, where torch's SDPA (flash attention on CPU) wins: those run one SDPA call each, on
this step's own K/V when the sequence has no cached prefix (nothing to gather) and on its gathered context
otherwise (a copy that is small next to the q_len x ctx work). The crossover, measured on the 2-core EPYC
(fresh causal prefill, 12/4 heads, head_dim 64, 1 and 2 threads): bf16 with the AVX512-BF16 dot product is
1.9-2.0x faster than SDPA up to 320 tokens and level at 2048; fp32 is 1.1-1.3x faster up to 512, slower at
768. The bf16 path without AVX512-BF16 (K widened per chunk) was not re-measured and keeps the old limit.
On a CPU with AMX, bf16 prefills, extends and decodes of GQA groups of 4+ run the paged kernel's AMX path
(kvkernels/cpu/paged_attention_amx.cpp; ``KVSERVE_CPU_ATTENTION_AMX=0`` keeps them on AVX-512). Measured on the
2-vCPU Sapphire Rapids Xeon (9/3 heads, head_dim 64, one thread, 30 layers, tools/attention_amx_ab.py): 8 fresh
prompts of 32-320 tokens in 68 ms on AMX against 150 ms through SDPA and 204 ms on AVX-512; one 1024-token
prompt 138 ms against SDPA's 164 ms, level at 2048 tokens, SDPA 1.24x faster at 4096 (so the 1024 limit stays;
docs/performance.md has the table). Fresh
prefills therefore go to SDPA from ``PAGED_MAX_FRESH_Q_BF16_AMX`` tokens only when the AMX path is off: then
torch's SDPA (AMX tiles too) is 1.25x faster than the AVX-512 kernel at 64 tokens, 2.2x at 320. Prefill chunks
over a cached prefix stay on the paged kernel up to the general limit: SDPA needs an explicit mask there (no flash
path).

On a CPU with AMX, bf16 caches are kept in the AMX block layout (``kv_block_layout`` says "amx-bf16"; the kernel's
paged_attention_amx.h defines it): per block and KV head, K^T and V already in the pair-interleaved order AMX's tile
products load, written once per token by ``store_kv``, so no step repacks them and every item runs on AMX,
SmolLM2's 3-row decodes included. Measured on the 2-vCPU Sapphire Rapids (tools/vs_vllm_inprocess.py attention,
SmolLM2's heads, 30 layer caches, one thread, in one process with vLLM's own AMX kernel on its own prepacked
cache): a decode step of 128 sequences 53.9 ms (vLLM 54.0; the token-order cache 74.6), a mixed step 85.0 (81.4;
99.1), fresh prompts 62.9 (54.9; 72.3). Whole-block copies (swap, host/disk/remote tiers, NIXL) carry it
unchanged; the tiers' fingerprints and the NIXL compatibility hash name it, so engines of the two layouts never
share blocks. With it, sequences are never gathered from the cache (``_one_sequence`` reads token order): extends
of any length stay on the paged kernel and only fresh prefills above ``PAGED_MAX_Q_BF16_DPBF16`` go to SDPA, on
this step's own K/V. ``KVSERVE_CPU_KV_PACKED=0`` keeps the token order (A/B runs).

Falls back to TorchAttentionBackend for whole calls it does not cover: sliding window or softcap (Gemma),
fp8 KV caches, dtypes other than float32/bfloat16/float16, and non-CPU tensors.

The backend also turns on the fused element-wise ops in runtime/models/llama.py (``fused_cpu_ops``):
residual-add + RMSNorm, in-place rotary and SiLU-and-mul (``KVSERVE_CPU_FUSED_OPS=0`` turns only those off).

Importing this module raises ImportError when the ops do not load, which
attention_backends.get_attention_backend turns into a clear ValueError.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kvserve.kernels import cpu_ops
from kvserve.runtime.models.attention import TOKEN_LAYOUT, AttentionMetadata, TorchAttentionBackend

if not cpu_ops.load():
    raise ImportError(cpu_ops.describe())

_ops = torch.ops.kvserve_cpu
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
AMX_LAYOUT = "amx-bf16"  # kv_block_layout's name for the AMX block layout


def amx_usable() -> bool:
    """This CPU has AMX tiles and the OS lets this process use them (torch asks Linux once, as the compiled kernel
    does; a container or kernel that refuses leaves both on their non-AMX paths)."""
    init_amx = getattr(torch._C._cpu, "_init_amx", None)
    return torch.cpu._is_amx_tile_supported() and (init_amx is None or bool(init_amx()))


def pack_kv_blocks(k_blocks: torch.Tensor, v_blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [n, block_size, kv_heads, head_dim] in token order -> the AMX block layout of the same shape
    (kvkernels/cpu/paged_attention_amx.h): per KV head, K as [block_size / 16][head_dim / 2][16][2] and V as
    [block_size / 2][head_dim][2]."""
    n, bs, heads, d = k_blocks.shape
    k = k_blocks.permute(0, 2, 1, 3).reshape(n, heads, bs // 16, 16, d // 2, 2).transpose(3, 4).reshape(n, bs, heads, d)
    v = v_blocks.permute(0, 2, 1, 3).reshape(n, heads, bs // 2, 2, d).transpose(3, 4).reshape(n, bs, heads, d)
    return k, v


def unpack_kv_blocks(k_blocks: torch.Tensor, v_blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of pack_kv_blocks: blocks in the AMX block layout -> token order."""
    n, bs, heads, d = k_blocks.shape
    k = k_blocks.reshape(n, heads, bs // 16, d // 2, 16, 2).transpose(3, 4).reshape(n, heads, bs, d).permute(0, 2, 1, 3)
    v = v_blocks.reshape(n, heads, bs // 2, d, 2).transpose(3, 4).reshape(n, heads, bs, d).permute(0, 2, 1, 3)
    return k, v


class CpuAttentionBackend:
    name = "cpu"
    # q_len above this: one SDPA call for the sequence instead of the paged kernel (see the module docstring)
    PAGED_MAX_Q_BF16_DPBF16 = 1024
    PAGED_MAX_Q_FP32 = 512
    PAGED_MAX_Q_OTHER = 48
    # fresh prefills (no cached prefix) above this: SDPA, on AMX CPUs in bf16 with the AMX path off (see above)
    PAGED_MAX_FRESH_Q_BF16_AMX = 56

    def __init__(self) -> None:
        self._torch = TorchAttentionBackend()
        self.fused_cpu_ops = os.environ.get("KVSERVE_CPU_FUSED_OPS", "1") != "0"
        self._has_dpbf16 = cpu_ops.isa_tag() == "avx512bf16"
        self._has_amx = amx_usable()
        # the paged kernel may put bf16 on AMX tiles (it still checks its own build, the OS and the shapes)
        self.amx_attention = self._has_amx and os.environ.get("KVSERVE_CPU_ATTENTION_AMX", "1") != "0"
        self.packed_kv = self.amx_attention and os.environ.get("KVSERVE_CPU_KV_PACKED", "1") != "0"
        self._packable: dict[tuple[int, int], bool] = {}  # (head_dim, block_size) -> the kernel's answer

    def kv_block_layout(self, kv_dtype: torch.dtype, head_dim: int, block_size: int) -> str:
        """How this backend orders the elements of a KV block: "amx-bf16" (the AMX block layout, see above) or
        "token" ([block_size, kv_heads, head_dim], every other backend's). The tiers and NIXL key on it."""
        if not (self.packed_kv and kv_dtype == torch.bfloat16):
            return TOKEN_LAYOUT
        key = (head_dim, block_size)
        if key not in self._packable:
            self._packable[key] = bool(_ops.packed_kv_usable(head_dim, block_size))
        return AMX_LAYOUT if self._packable[key] else TOKEN_LAYOUT

    def _packs(self, k_cache: torch.Tensor) -> bool:
        """This cache is in the AMX block layout (a contiguous cache whose dtype and shape take it)."""
        packable = self.kv_block_layout(k_cache.dtype, k_cache.shape[3], k_cache.shape[1]) == AMX_LAYOUT
        return packable and k_cache.is_contiguous()

    def paged_max_q(self, dtype: torch.dtype, head_dim: int) -> int:
        if dtype == torch.float32:
            return self.PAGED_MAX_Q_FP32
        if dtype == torch.bfloat16 and self._has_dpbf16 and head_dim % 32 == 0:  # the kernel's dpbf16 condition
            return self.PAGED_MAX_Q_BF16_DPBF16
        return self.PAGED_MAX_Q_OTHER

    def paged_max_fresh_q(self, dtype: torch.dtype) -> int:
        """Fresh prefills longer than this go to SDPA; -1: only ``paged_max_q`` applies."""
        sdpa_wins = dtype == torch.bfloat16 and self._has_amx and not self.amx_attention
        return self.PAGED_MAX_FRESH_Q_BF16_AMX if sdpa_wins else -1

    def _supported(self, q: torch.Tensor, k_cache: torch.Tensor, sliding_window: int, softcap: float) -> bool:
        return (
            not sliding_window
            and not softcap
            and q.device.type == "cpu"
            and q.dtype in _DTYPES
            and k_cache.dtype == q.dtype
            and k_cache.is_contiguous()
        )

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        packed: bool | None = None,
    ) -> None:
        """packed: whether k_cache is in the AMX block layout, when the caller (forward) already asked _packs."""
        if k_cache.dtype not in _DTYPES or k.device.type != "cpu" or not k_cache.is_contiguous():
            return self._torch.store_kv(k, v, k_cache, v_cache, meta)
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
        k = k if k.stride(-1) == 1 else k.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
        packed = self._packs(k_cache) if packed is None else packed
        _ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, packed)

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
        if not self._supported(q, k_cache, sliding_window, softcap):
            return self._torch.forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window, softcap)
        packed = self._packs(k_cache)  # once per layer call: the store and the read must agree
        self.store_kv(k, v, k_cache, v_cache, meta, packed)
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype)
        if packed:  # nothing reads a packed cache but the kernel: only fresh prefills may leave it (for SDPA)
            limit, fresh_limit = 1 << 30, self.PAGED_MAX_Q_BF16_DPBF16
        else:
            limit, fresh_limit = self.paged_max_q(q.dtype, q.shape[-1]), self.paged_max_fresh_q(q.dtype)
        _ops.paged_attention(
            out,
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.cu_seqlens_q,
            scale,
            limit,
            fresh_limit,
            self.amx_attention,
            packed,
        )
        if meta.max_seqlen_q > min(limit, fresh_limit if fresh_limit >= 0 else limit):
            start = 0
            for s, (q_len, ctx_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
                if q_len > limit or (0 <= fresh_limit < q_len == ctx_len):
                    rows = slice(start, start + q_len)
                    if q_len == ctx_len:  # a fresh prefill: its keys are exactly this step's K/V
                        o = F.scaled_dot_product_attention(
                            q[rows].transpose(0, 1).unsqueeze(0),
                            k[rows].to(q.dtype).transpose(0, 1).unsqueeze(0),
                            v[rows].to(q.dtype).transpose(0, 1).unsqueeze(0),
                            is_causal=True,
                            scale=scale,
                            enable_gqa=True,
                        )
                        out[rows] = o.squeeze(0).transpose(0, 1)
                    else:
                        out[rows] = self._torch._one_sequence(
                            q[rows], k_cache, v_cache, meta.block_tables[s], ctx_len, scale
                        )
                start += q_len
        return out

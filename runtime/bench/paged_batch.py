"""Random paged-attention batches: the input of the attention benchmarks (`kvserve bench cpu-attention`, the GPU
kernel check in gpu_kernels.py) and of the kernel tests, with the error measure they compare outputs by.
Scattered blocks and NaN-poisoned slots make a kernel that reads outside a sequence's context visible.
The independent oracle the tests compare against (dense causal attention) lives in tests/kernel_testing.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.kernels.kv_dtypes import is_fp8


@dataclass
class PagedBatch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_new: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]: this step's keys (before storing)
    v_new: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]; prefixes filled, rest poisoned
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32 (context + new tokens)
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 for padding tokens
    max_seqlen_q: int
    max_seqlen_k: int
    k_full: list  # per sequence: [seq_len, num_kv_heads, head_dim] float32 keys as attention should see them
    v_full: list
    k_scale: float | None = None
    v_scale: float | None = None

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5


def make_paged_batch(
    query_lens,
    context_lens,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype=torch.float32,
    cache_dtype=None,
    pad_tokens: int = 0,
    device="cpu",
    generator: torch.Generator | None = None,
    poison: float = float("nan"),
    prefilled_new: bool = True,
) -> PagedBatch:
    """A batch where sequence ``s`` has ``context_lens[s]`` cached tokens and ``query_lens[s]`` new ones.

    Blocks are drawn from a shuffled pool (block 0 is never used, as the padding block), so each sequence's
    blocks are scattered; every cache element no sequence owns is ``poison`` (NaN by default) so a kernel
    that reads outside a sequence's context produces NaN. With ``prefilled_new`` the new tokens' K/V are
    already in the cache (attention-only tests); otherwise their slots hold poison until stored.
    ``pad_tokens`` extra query rows with slot -1 are appended (they belong to no sequence).
    Float8 ``cache_dtype`` stores quantized values with per-tensor scales; ``k_full``/``v_full`` hold the
    dequantized values the kernels must attend over.
    """
    g = generator
    cache_dtype = cache_dtype or dtype
    fp8 = is_fp8(cache_dtype)
    seq_lens = [c + q for q, c in zip(query_lens, context_lens)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    pool = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    max_blocks = max(blocks_per_seq + [1])
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), poison, dtype=torch.float32)
    v_cache = torch.full_like(k_cache, poison)
    k_scale = v_scale = None
    if fp8:
        r = torch.rand(2, generator=g).tolist()
        k_scale, v_scale = 0.02 + 0.1 * r[0], 0.02 + 0.1 * r[1]
    num_tokens = sum(query_lens) + pad_tokens
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g)
    k_new = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    v_new = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64)
    k_full, v_full = [], []
    tok = 0
    for s, (ql, cl) in enumerate(zip(query_lens, context_lens)):
        n = ql + cl
        blocks = pool[: blocks_per_seq[s]]
        pool = pool[blocks_per_seq[s] :]
        block_tables[s, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        pos = torch.arange(n)
        phys = torch.tensor(blocks, dtype=torch.long)[pos // block_size] if n else torch.zeros(0, dtype=torch.long)
        kf = torch.randn(n, num_kv_heads, head_dim, generator=g)
        vf = torch.randn(n, num_kv_heads, head_dim, generator=g)
        kf[cl:] = k_new[tok : tok + ql]
        vf[cl:] = v_new[tok : tok + ql]
        # Round through the model dtype first: that's what the runtime would hold.
        kf, vf = kf.to(dtype).float(), vf.to(dtype).float()
        kc, vc = kf, vf  # what the cache holds (as float32; exact in the cache dtype)
        if fp8:
            from kvserve.kernels.reference import dequantize_from_cache, quantize_to_cache

            kq, vq = quantize_to_cache(kf, cache_dtype, k_scale), quantize_to_cache(vf, cache_dtype, v_scale)
            kc, vc = kq.float(), vq.float()
            kf, vf = dequantize_from_cache(kq, k_scale), dequantize_from_cache(vq, v_scale)
        stored = n if prefilled_new else cl
        k_cache[phys[:stored], pos[:stored] % block_size] = kc[:stored]
        v_cache[phys[:stored], pos[:stored] % block_size] = vc[:stored]
        slot_mapping[tok : tok + ql] = phys[cl:] * block_size + pos[cl:] % block_size
        k_full.append(kf)
        v_full.append(vf)
        tok += ql
    cu = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(list(query_lens), dtype=torch.int32), 0)
    to = dict(device=device)
    return PagedBatch(
        q=q.to(dtype).to(**to),
        k_new=k_new.to(dtype).to(**to),
        v_new=v_new.to(dtype).to(**to),
        k_cache=k_cache.to(cache_dtype).to(**to),
        v_cache=v_cache.to(cache_dtype).to(**to),
        block_tables=block_tables.to(**to),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=cu.to(**to),
        slot_mapping=slot_mapping.to(**to),
        max_seqlen_q=max(query_lens),
        max_seqlen_k=max(seq_lens),
        k_full=k_full,
        v_full=v_full,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (inf if out has NaN/inf where ref is finite)."""
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()

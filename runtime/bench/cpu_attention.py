"""Per-layer CPU attention microbenchmark: the pure-torch backend against the compiled 'cpu' backend.

One decode step of one layer (store this step's K/V + paged attention), B decodes with contexts drawn
uniformly from [32, 430] (mean ~231), 12 query / 4 KV heads, head_dim 64, block size 16, blocks shuffled.
Prints min and median ms over --iters calls per (dtype, threads). The machine is shared, so run it more
than once; the 1-thread numbers are the steadiest.

    python runtime/bench/cpu_attention.py [--batch 64] [--iters 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve.runtime.bench.paged_batch import make_paged_batch
from kvserve.runtime.models.attention import AttentionMetadata, TorchAttentionBackend
from kvserve.runtime.models.attention_backends import get_attention_backend


def _meta(b) -> AttentionMetadata:
    q_lens = (b.cu_seqlens_q[1:] - b.cu_seqlens_q[:-1]).tolist()
    return AttentionMetadata(
        slot_mapping=b.slot_mapping,
        cu_seqlens_q=b.cu_seqlens_q,
        seq_lens=b.seq_lens,
        block_tables=b.block_tables,
        max_seqlen_q=b.max_seqlen_q,
        max_seqlen_k=b.max_seqlen_k,
        query_lens_list=q_lens,
        seq_lens_list=b.seq_lens.tolist(),
    )


def _time(fn, iters: int) -> tuple[float, float]:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return min(ts), statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(32, 431, (args.batch,), generator=gen).tolist()
    cpu = get_attention_backend("cpu")
    ref = TorchAttentionBackend()
    print(
        f"B={args.batch} decodes, mean context {sum(ctx) / len(ctx) + 1:.0f}, 12 q / 4 kv heads, head_dim 64, "
        f"block 16; ms per layer-step (min / median of {args.iters})"
    )
    print(f"{'dtype':9} {'threads':>7} {'torch backend':>16} {'cpu backend':>14} {'speed-up (median)':>18}")
    for dtype in (torch.bfloat16, torch.float32):
        b = make_paged_batch(
            [1] * args.batch,
            ctx,
            num_heads=12,
            num_kv_heads=4,
            head_dim=64,
            block_size=16,
            dtype=dtype,
            generator=gen,
            poison=0.0,
        )
        meta = _meta(b)
        for threads in args.threads:
            torch.set_num_threads(threads)
            res = {}
            for name, backend in (("torch", ref), ("cpu", cpu)):
                res[name] = _time(
                    lambda: backend.forward(b.q, b.k_new, b.v_new, b.k_cache, b.v_cache, meta, b.scale), args.iters
                )
            (t_min, t_med), (c_min, c_med) = res["torch"], res["cpu"]
            print(
                f"{str(dtype).split('.')[-1]:9} {threads:>7} {t_min:7.2f} / {t_med:6.2f} {c_min:6.2f} / {c_med:5.2f} "
                f"{t_med / c_med:17.1f}x"
            )


if __name__ == "__main__":
    main()

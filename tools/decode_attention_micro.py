"""The compiled CPU paged-attention op on a decode batch, alone (issue 39's gap analysis, docs/performance.md):
128 sequences of 201-241 tokens of context, SmolLM2's 9/3 heads of 64, bf16, block size 128, one thread; 30
calls per sample, either on 30 separate layer caches (the engine's case: each layer's KV comes from memory) or
30 times on one layer's cache (its 20 MB stays in cache: the kernel's own floor).

    taskset -c 1 .venv/bin/python tools/decode_attention_micro.py [--no-amx]

--no-amx keeps bf16 on the AVX-512 kernel on an AMX CPU (the op's allow_amx=False), for an A/B of the two.
"""

from __future__ import annotations

import random
import sys
import time

import torch


def main() -> None:
    from kvserve.kernels import cpu_ops
    from kvserve.runtime.executor.cpu_malloc import zeroed_cpu_tensor

    allow_amx = "--no-amx" not in sys.argv[1:]
    if not cpu_ops.load():
        raise SystemExit(cpu_ops.describe())
    torch.set_num_threads(1)
    heads, kv_heads, head_dim, block_size, seqs, layers = 9, 3, 64, 128, 128, 30
    rng = random.Random(0)
    lens = [rng.randint(201, 241) for _ in range(seqs)]
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks) + 1  # block 0 unused, as the engine's null block
    tables = torch.zeros(seqs, max(blocks), dtype=torch.int32)
    first = 1
    for s, n in enumerate(blocks):  # consecutive blocks, as a fresh engine allocates them
        tables[s, :n] = torch.arange(first, first + n)
        first += n
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cu = torch.arange(seqs + 1, dtype=torch.int32)
    q = torch.randn(seqs, heads + 2 * kv_heads, head_dim, dtype=torch.bfloat16)[:, :heads]  # a view, as the qkv split
    out = torch.empty(seqs, heads, head_dim, dtype=torch.bfloat16)
    kv_bytes = sum(lens) * kv_heads * head_dim * 2 * 2 * layers
    for caches in (layers, 1):
        shape = (num_blocks, block_size, kv_heads, head_dim)
        kc = [zeroed_cpu_tensor(shape, torch.bfloat16).normal_() for _ in range(caches)]
        vc = [zeroed_cpu_tensor(shape, torch.bfloat16).normal_() for _ in range(caches)]

        samples = []
        for _ in range(11):  # the first one warms up
            t0 = time.perf_counter()
            for layer in range(layers):
                torch.ops.kvserve_cpu.paged_attention(
                    out,
                    q,
                    kc[layer % caches],
                    vc[layer % caches],
                    tables,
                    seq_lens,
                    cu,
                    head_dim**-0.5,
                    4096,
                    -1,
                    allow_amx,
                )
            samples.append(time.perf_counter() - t0)
        samples = samples[1:]
        best = min(samples)
        what = ("AMX allowed, " if allow_amx else "AVX-512 kernel, ") + (
            "30 layer caches" if caches == layers else "one layer cache x30"
        )
        print(
            f"{what}: {best * 1e3:.1f} ms per decode step (best of 10; median {sorted(samples)[5] * 1e3:.1f}); "
            f"KV {kv_bytes / 1e6:.0f} MB -> {kv_bytes / best / 1e9:.1f} GB/s"
        )


if __name__ == "__main__":
    main()

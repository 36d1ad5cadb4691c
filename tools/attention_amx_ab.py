"""The compiled CPU paged attention on AMX tiles against its AVX-512 kernel (and torch's SDPA for fresh prefills), bf16,
one op call per layer, interleaved in one process (AMX, AVX-512, AVX-512, AMX, ...) so that both see the same machine
state; prints min and median per step. The numbers in paged_attention_amx.h, attention_cpu.py and
docs/performance.md come from it. Without AMX (CPU or OS) it times the AVX-512 kernel alone.

    taskset -c 1 .venv/bin/python tools/attention_amx_ab.py decode|fresh|prefix|long1024 [--heads 9,3,64]
        [--layers 30] [--rounds 24] [--threads 1] [--kv-in-l2 | --one-layer-cache] [--dtype float32]

decode: 128 sequences of 201-241 keys, one new token each; fresh: 8 prompts of 32-320 tokens, no cached prefix
(plus SDPA on the same tensors); prefix: 8 chunks of 32-320 tokens over 0-300 cached tokens; longN: one fresh
N-token prompt (plus SDPA). --dtype float32: the AVX-512 kernel (fp32 never runs on AMX) and SDPA.
--kv-in-l2: every sequence reads the same blocks of one layer cache (the kernel's own cost, no memory traffic);
--one-layer-cache: every layer reads the same 20 MB cache with each sequence's own blocks
(it stays in the last-level cache); otherwise each layer has its own cache, as in the engine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F


def main() -> None:
    from kvserve.kernels import cpu_ops
    from kvserve.runtime.executor.cpu_malloc import zeroed_cpu_tensor

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode")
    ap.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head_dim (default SmolLM2's)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="float32: AVX-512 and SDPA")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--kv-in-l2", action="store_true")
    where.add_argument("--one-layer-cache", action="store_true")
    args = ap.parse_args()
    if not cpu_ops.load():
        raise SystemExit(cpu_ops.describe())
    from kvserve.runtime.models.attention_cpu import amx_usable, pack_kv_blocks

    # "AMX": AMX where the kernel takes it; "packed": AMX on caches in the AMX block layout (every item on AMX)
    dtype = getattr(torch, args.dtype)
    paths = ("AMX", "AVX-512", "packed") if amx_usable() and dtype == torch.bfloat16 else ("AVX-512",)
    torch.set_num_threads(args.threads)
    heads, kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    rng = random.Random(0)
    mode = args.mode
    if mode == "decode":
        q_lens = [1] * 128
        lens = [rng.randint(201, 241) for _ in q_lens]
    elif mode.startswith("long"):
        q_lens = [int(mode[4:])]
        lens, mode = list(q_lens), "fresh"
    elif mode in ("fresh", "prefix"):
        q_lens = [rng.randint(32, 320) for _ in range(8)]
        lens = [q + (0 if mode == "fresh" else rng.randint(0, 300)) for q in q_lens]
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    seqs, bs = len(q_lens), args.block_size
    blocks = [-(-n // bs) for n in lens]
    tables = torch.zeros(seqs, max(blocks), dtype=torch.int32)
    first = 1  # block 0 unused, as the engine's null block
    for s, n in enumerate(blocks):
        tables[s, :n] = torch.arange(first, first + n)
        first += n
    if args.kv_in_l2:
        tables[:] = tables[0]
        lens = [lens[0]] * seqs
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cu = torch.zeros(seqs + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    tokens = int(cu[-1])
    q = torch.randn(tokens, heads + 2 * kv_heads, head_dim, dtype=dtype)[:, :heads]  # a view, as qkv split
    out = torch.empty(tokens, heads, head_dim, dtype=dtype)
    shape = (first, bs, kv_heads, head_dim)
    caches = 1 if args.kv_in_l2 or args.one_layer_cache else args.layers
    kc = [zeroed_cpu_tensor(shape, dtype).normal_() for _ in range(caches)]
    vc = [zeroed_cpu_tensor(shape, dtype).normal_() for _ in range(caches)]
    packed = [pack_kv_blocks(k, v) for k, v in zip(kc, vc)] if "packed" in paths else []
    packed = [
        (zeroed_cpu_tensor(shape, dtype).copy_(k), zeroed_cpu_tensor(shape, dtype).copy_(v)) for k, v in packed
    ]  # huge pages, as the token-order caches and the engine's
    scale = head_dim**-0.5

    def step(path: str) -> float:
        t0 = time.perf_counter()
        for layer in range(args.layers):
            k, v = packed[layer % caches] if path == "packed" else (kc[layer % caches], vc[layer % caches])
            torch.ops.kvserve_cpu.paged_attention(
                out, q, k, v, tables, seq_lens, cu, scale, 1 << 30, -1, path != "AVX-512", path == "packed"
            )
        return time.perf_counter() - t0

    # SDPA on a fresh prompt reads this step's own K/V (the backend's route): contiguous tensors of the same size
    k_new = torch.randn(tokens, kv_heads, head_dim, dtype=dtype)
    v_new = torch.randn_like(k_new)

    def sdpa_step() -> float:
        t0 = time.perf_counter()
        for _ in range(args.layers):
            for s in range(seqs):
                a, b = int(cu[s]), int(cu[s + 1])
                o = F.scaled_dot_product_attention(
                    q[a:b].transpose(0, 1).unsqueeze(0),
                    k_new[a:b].transpose(0, 1).unsqueeze(0),
                    v_new[a:b].transpose(0, 1).unsqueeze(0),
                    is_causal=True,
                    scale=scale,
                    enable_gqa=True,
                )
                out[a:b] = o.squeeze(0).transpose(0, 1)
        return time.perf_counter() - t0

    runs: dict[str, list[float]] = {"AMX": [], "AVX-512": [], "packed": [], "SDPA": []}
    for i in range(args.rounds):
        for path in paths if i % 2 else paths[::-1]:
            runs[path].append(step(path))
        if mode == "fresh":
            runs["SDPA"].append(sdpa_step())
    caches_are = "KV in L2" if args.kv_in_l2 else "one layer cache" if args.one_layer_cache else "layer caches"
    print(f"{args.mode}, heads {args.heads}, {args.threads} thread(s), {caches_are}, {args.layers} layers per step:")
    for name, samples in runs.items():
        if samples:
            kept = samples[2:] or samples  # the first two rounds warm up
            print(f"  {name:8s} min {min(kept) * 1e3:8.1f} ms   median {statistics.median(kept) * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()

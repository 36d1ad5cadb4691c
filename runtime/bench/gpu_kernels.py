#!/usr/bin/env python
"""GPU check-and-benchmark for kvserve.kernels (one command, < 10 minutes on one GPU).

On CUDA:
  1. correctness: every kernel against its torch reference on random shapes (store bit-exact; attention
     rel err = max|out-ref|/max|ref| <= 1e-5 fp32, <= 1e-2 bf16/fp16; fp8 KV caches included);
  2. bandwidth: a device-to-device copy (read + write bytes / s) as the attainable-bandwidth yardstick;
  3. decode attention over a batch x context grid (Llama-3-8B layer shape: 32 q heads, 8 KV heads, head dim
     128, bf16, block 16), timed with CUDA events: split-K auto vs the 2D kernel vs the torch backend, as KV
     bytes read per second and as a fraction of the copy bandwidth;
  4. end to end: decode tokens/s of a Llama-3-8B-shaped random bf16 model through LLM(...) with the triton
     vs the torch attention backend (load_format="dummy": weights made on the GPU, no 16 GB checkpoint written).
It writes JSON (--out) and prints a table; exit status 1 if any correctness check fails.

Without CUDA, or with --cpu-smoke, it sets TRITON_INTERPRET=1 and runs the same code paths at tiny sizes
under the Triton interpreter (the timings are then meaningless; the point is that the script works).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import time

GRID_BATCHES = (1, 8, 32, 128, 256)
GRID_CONTEXTS = (512, 2048, 8192, 32768)
MAX_GRID_TOKENS = 1 << 23  # B * ctx cap: 8M tokens (256 x 32k) = 32 GiB of bf16 K+V for one layer of this shape
LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
TINY_MODEL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes under the Triton interpreter on CPU")
    p.add_argument("--out", default="gpu_kernels_results.json", help="JSON results path")
    p.add_argument("--skip-e2e", action="store_true", help="skip the end-to-end model benchmark")
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting new grid/e2e work after this")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class Clock:
    """CUDA-event timing on GPU, perf_counter on CPU; returns milliseconds per call (median of reps)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def time(self, fn, warmup: int = 3, reps: int = 20) -> float:
        import torch

        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        times.sort()
        return times[len(times) // 2]


# -- 1. correctness -------------------------------------------------------------------------------------
def run_checks(device, smoke: bool, seed: int) -> list[dict]:
    import torch

    from kvserve.kernels import paged_attention, paged_attention_ref, store_kv_cache, store_kv_cache_ref
    from kvserve.runtime.bench.paged_batch import make_paged_batch, rel_err

    g = torch.Generator().manual_seed(seed)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
    fp8_types = [torch.float8_e5m2]
    if device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9):
        fp8_types.insert(0, torch.float8_e4m3fn)  # e4m3 conversions need sm89+ (Ada/Hopper)
    heads = [(32, 8, 128), (8, 1, 64), (16, 2, 80), (28, 4, 128), (4, 4, 96)]
    dtypes = [torch.float32, torch.bfloat16] + ([] if smoke else [torch.float16])
    max_ctx = 96 if smoke else 2000
    results = []

    def rnd(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    def record(kind, shape, dtype, cache_dtype, err, limit, extra=None):
        results.append(
            dict(
                kernel=kind,
                shape=shape,
                dtype=str(dtype).replace("torch.", ""),
                cache_dtype=str(cache_dtype).replace("torch.", ""),
                rel_err=err,
                tol=limit,
                ok=bool(err <= limit),
                **(extra or {}),
            )
        )

    pairs = [(hd, dt) for hd in heads for dt in dtypes]
    if smoke:  # one head shape per dtype: GQA 8 with head dim 64, GQA 8 with odd head dim 80
        pairs = [(heads[1], torch.float32), (heads[2], torch.bfloat16)]
    for (h, kvh, d), dtype in pairs:
        for cache_dtype in [None] + (fp8_types if dtype != torch.float32 or smoke else fp8_types[:1]):
            bs = 16 if rnd(0, 1) else 32
            n_dec, n_pre = (2, 1) if smoke else (rnd(1, 24), rnd(1, 4))
            q_lens = [1] * n_dec + [rnd(2, 40 if smoke else 300) for _ in range(n_pre)]
            ctx = [rnd(0, max_ctx) for _ in q_lens]
            shape = dict(heads=h, kv_heads=kvh, head_dim=d, block_size=bs, q_lens=q_lens, ctx=ctx)
            b = make_paged_batch(
                q_lens,
                ctx,
                num_heads=h,
                num_kv_heads=kvh,
                head_dim=d,
                block_size=bs,
                dtype=dtype,
                cache_dtype=cache_dtype,
                pad_tokens=2,
                prefilled_new=False,
                device=device,
                generator=g,
            )
            # store: bit-exact against the reference store into a copy of the cache
            kr, vr = b.k_cache.clone(), b.v_cache.clone()
            store_kv_cache_ref(b.k_new, b.v_new, kr, vr, b.slot_mapping, b.k_scale, b.v_scale)
            store_kv_cache(b.k_new, b.v_new, b.k_cache, b.v_cache, b.slot_mapping, b.k_scale, b.v_scale)
            ib = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[b.k_cache.element_size()]
            same = torch.equal(b.k_cache.view(ib), kr.view(ib)) and torch.equal(b.v_cache.view(ib), vr.view(ib))
            record("store_kv_cache", shape, dtype, cache_dtype or dtype, 0.0 if same else float("inf"), 0.0)
            lim = tol[dtype]
            ref = paged_attention_ref(
                b.q,
                b.k_cache,
                b.v_cache,
                b.block_tables,
                b.seq_lens,
                b.cu_seqlens_q,
                b.max_seqlen_q,
                b.max_seqlen_k,
                b.scale,
                b.k_scale,
                b.v_scale,
            )
            n = int(b.cu_seqlens_q[-1])
            out = torch.full_like(b.q, float("nan"))
            paged_attention(
                b.q,
                b.k_cache,
                b.v_cache,
                b.block_tables,
                b.seq_lens,
                b.cu_seqlens_q,
                b.max_seqlen_q,
                b.max_seqlen_k,
                b.scale,
                b.k_scale,
                b.v_scale,
                out=out,
            )
            record("paged_attention[mixed,2d]", shape, dtype, cache_dtype or dtype, rel_err(out[:n], ref[:n]), lim)
            # decode-only batch from the same sequences' contexts: split-K with 4 segments and 2D
            dq = make_paged_batch(
                [1] * len(ctx),
                ctx,
                num_heads=h,
                num_kv_heads=kvh,
                head_dim=d,
                block_size=bs,
                dtype=dtype,
                cache_dtype=cache_dtype,
                device=device,
                generator=g,
            )
            ref = paged_attention_ref(
                dq.q,
                dq.k_cache,
                dq.v_cache,
                dq.block_tables,
                dq.seq_lens,
                dq.cu_seqlens_q,
                1,
                dq.max_seqlen_k,
                dq.scale,
                dq.k_scale,
                dq.v_scale,
            )
            for segs, name in ((4, "paged_attention[decode,split-k]"), (1, "paged_attention[decode,2d]")):
                out = torch.full_like(dq.q, float("nan"))
                paged_attention(
                    dq.q,
                    dq.k_cache,
                    dq.v_cache,
                    dq.block_tables,
                    dq.seq_lens,
                    dq.cu_seqlens_q,
                    1,
                    dq.max_seqlen_k,
                    dq.scale,
                    dq.k_scale,
                    dq.v_scale,
                    out=out,
                    num_segments=segs,
                )
                record(name, dict(shape, q_lens=[1] * len(ctx)), dtype, cache_dtype or dtype, rel_err(out, ref), lim)
    return results


# -- 2. copy bandwidth ----------------------------------------------------------------------------------
def copy_bandwidth(device, clock, smoke: bool) -> float:
    """Bytes moved (read + written) per second by a device-to-device copy."""
    import torch

    n = (1 << 20) if smoke else (1 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = clock.time(lambda: dst.copy_(src), warmup=2, reps=5 if smoke else 20)
    src = dst = None  # free the device memory (the timing closure is done with them)
    return 2 * n / (ms * 1e-3)


# -- 3. decode attention grid ---------------------------------------------------------------------------
def decode_grid(device, clock, smoke: bool, copy_bps: float, deadline: float) -> list[dict]:
    import torch

    from kvserve.kernels import choose_num_segments, paged_attention

    h, kvh, d, bs, dtype = (32, 8, 128, 16, torch.bfloat16)
    batches, contexts = ((1, 2), (48, 100)) if smoke else (GRID_BATCHES, GRID_CONTEXTS)
    cap = 100 if smoke else MAX_GRID_TOKENS
    points = [(b, c) for c in contexts for b in batches if b * c <= cap]
    num_blocks = max(b * -(-c // bs) for b, c in points) + 1
    k_cache = torch.randn(num_blocks, bs, kvh, d, device=device, dtype=dtype)
    v_cache = torch.randn(num_blocks, bs, kvh, d, device=device, dtype=dtype)
    try:
        from kvserve.runtime.models.attention import AttentionMetadata, TorchAttentionBackend

        torch_backend = TorchAttentionBackend()
    except Exception:  # runtime absent or changed: report the kernels only
        torch_backend = None
    rows = []
    for batch, ctx in points:
        if time.monotonic() > deadline:
            rows.append(dict(batch=batch, context=ctx, skipped="time budget"))
            continue
        nblk = -(-ctx // bs)
        perm = torch.randperm(num_blocks - 1, device=device)[: batch * nblk] + 1
        block_tables = perm.view(batch, nblk).to(torch.int32)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
        q = torch.randn(batch, h, d, device=device).to(dtype)
        out = torch.empty_like(q)
        scale = d**-0.5
        kv_bytes = 2 * batch * ctx * kvh * d * k_cache.element_size()
        io_bytes = kv_bytes + 2 * q.numel() * q.element_size() + block_tables.numel() * 4
        reps = 1 if smoke else 20
        segs = choose_num_segments(batch, kvh, ctx, 32, device)

        def run(num_segments=None):
            return lambda: paged_attention(
                q, k_cache, v_cache, block_tables, seq_lens, cu, 1, ctx, scale, out=out, num_segments=num_segments
            )

        row = dict(batch=batch, context=ctx, kv_bytes=kv_bytes, segments=segs)
        row["triton_ms"] = clock.time(run(), warmup=1 if smoke else 3, reps=reps)
        row["triton_2d_ms"] = clock.time(run(1), warmup=1 if smoke else 3, reps=reps)
        if torch_backend is not None and batch * ctx <= (1 << 20):
            meta = AttentionMetadata(
                slot_mapping=torch.full((batch,), -1, dtype=torch.long, device=device),
                cu_seqlens_q=cu,
                seq_lens=seq_lens,
                block_tables=block_tables,
                max_seqlen_q=1,
                max_seqlen_k=ctx,
                query_lens_list=[1] * batch,
                seq_lens_list=[ctx] * batch,
            )
            rows_idx = list(range(batch))
            k_new = torch.zeros(batch, kvh, d, dtype=dtype, device=device)
            try:  # the backend's decode path alone (a private helper: fall back to forward if it changed)
                row["torch_ms"] = clock.time(
                    lambda: torch_backend._decode_batch(q, k_cache, v_cache, meta, scale, rows_idx, out),
                    warmup=1,
                    reps=reps,
                )
            except Exception:
                try:  # forward = store (all slots -1 here) + attention
                    meta.has_padding_slots = True
                    row["torch_ms"] = clock.time(
                        lambda: torch_backend.forward(q, k_new, k_new, k_cache, v_cache, meta, scale),
                        warmup=1,
                        reps=reps,
                    )
                except Exception as exc:
                    row["torch_error"] = repr(exc)[:200]
        row["triton_GBps"] = io_bytes / (row["triton_ms"] * 1e-3) / 1e9
        row["frac_of_copy_bw"] = (io_bytes / (row["triton_ms"] * 1e-3)) / copy_bps
        rows.append(row)
    k_cache = v_cache = None  # free the device memory
    return rows


# -- 4. end to end --------------------------------------------------------------------------------------
def end_to_end(device, smoke: bool, deadline: float) -> dict:
    import torch

    from kvserve.runtime import LLM, SamplingParams
    from kvserve.runtime.models.synthetic import make_shape_dir

    shape = TINY_MODEL if smoke else LLAMA3_8B
    dtype = "float32" if smoke else "bfloat16"
    batch, prompt_len, new_tokens = (3, 20, 4) if smoke else (64, 512, 128)
    tmp = make_shape_dir(tempfile.mkdtemp(prefix="kvserve-e2e-"), "LlamaForCausalLM", dtype, **shape)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, shape["vocab_size"], (prompt_len,), generator=gen).tolist() for _ in range(batch)]
    result = dict(
        model="Llama-3-8B shape, random weights" if not smoke else "tiny",
        dtype=dtype,
        batch=batch,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
    )
    tokens = {}
    for backend in ("triton", "torch"):
        if time.monotonic() > deadline:
            result[backend] = dict(skipped="time budget")
            continue
        kw = dict(
            max_model_len=prompt_len + new_tokens + 16,
            attention_backend=backend,
            dtype=dtype,
            device=str(device),
            max_num_seqs=batch,
            block_size=16,
            load_format="dummy",
        )
        if device.type == "cuda":
            # An explicit budget (what this batch needs, x1.5), not a share of the device: should the first
            # backend's engine outlive its `del`, the second still fits beside it.
            from kvserve.runtime import capacity

            layout = capacity.kv_layout(capacity.shape_from_hf_config(shape), dtype, "auto", 16, 1)
            kw["kv_cache_bytes"] = int(1.5 * batch * (prompt_len + new_tokens + 16) * layout.bytes_per_token)
        else:
            kw["num_kv_blocks"] = batch * ((prompt_len + new_tokens) // 16 + 2) + 4
        llm = LLM(tmp, **kw)

        def gen_time(n):
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            if device.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - t, [o.outputs[0].token_ids for o in outs]

        if not smoke:
            gen_time(2)  # warm-up: Triton JIT compiles, allocator
        t1, _ = gen_time(1)  # prefill + first token
        tn, toks = gen_time(new_tokens)
        tokens[backend] = toks
        decode_tps = batch * (new_tokens - 1) / max(tn - t1, 1e-9)
        result[backend] = dict(
            prefill_plus_first_s=t1,
            total_s=tn,
            decode_tokens_per_s=decode_tps,
            kv_blocks=llm.engine.config.cache.num_blocks,
        )
        llm = None  # free the device memory
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if len(tokens) == 2:
        # bf16 roundoff differs between the backends, so greedy paths may diverge after a while on a
        # random model; report the agreement rather than assert it.
        same = sum(a == b for a, b in zip(tokens["triton"], tokens["torch"]))
        result["identical_sequences"] = f"{same}/{batch}"
        first = sum(a[0] == b[0] for a, b in zip(tokens["triton"], tokens["torch"]))
        result["identical_first_tokens"] = f"{first}/{batch}"
    if all(isinstance(result.get(b), dict) and "decode_tokens_per_s" in result[b] for b in ("triton", "torch")):
        result["speedup_triton_vs_torch"] = (
            result["triton"]["decode_tokens_per_s"] / result["torch"]["decode_tokens_per_s"]
        )
    return result


def _table(results: dict) -> str:
    lines = []
    checks = results["checks"]
    bad = [c for c in checks if not c["ok"]]
    worst = {}
    for c in checks:
        key = (c["kernel"], c["dtype"], c["cache_dtype"])
        worst[key] = max(worst.get(key, 0.0), c["rel_err"])
    lines.append(f"device: {results['device']}   correctness: {len(checks) - len(bad)}/{len(checks)} ok")
    lines.append(f"{'kernel':34s} {'dtype':9s} {'cache':14s} {'max rel err':>12s}")
    for (k, dt, cd), e in sorted(worst.items()):
        lines.append(f"{k:34s} {dt:9s} {cd:14s} {e:12.3g}")
    lines.append(f"device-to-device copy: {results['copy_GBps']:.1f} GB/s (read + write)")
    lines.append(
        f"{'batch':>6s} {'ctx':>6s} {'segs':>4s} {'triton ms':>10s} {'2d ms':>9s} {'torch ms':>9s} "
        f"{'GB/s':>8s} {'% copy':>7s}"
    )
    for r in results["decode_grid"]:
        if "skipped" in r:
            lines.append(f"{r['batch']:6d} {r['context']:6d}  skipped ({r['skipped']})")
            continue
        torch_ms = f"{r['torch_ms']:9.3f}" if "torch_ms" in r else f"{'-':>9s}"
        lines.append(
            f"{r['batch']:6d} {r['context']:6d} {r['segments']:4d} {r['triton_ms']:10.3f} "
            f"{r['triton_2d_ms']:9.3f} {torch_ms} {r['triton_GBps']:8.1f} {100 * r['frac_of_copy_bw']:6.1f}%"
        )
    e2e = results.get("e2e")
    if e2e:
        lines.append(f"end to end ({e2e.get('model')}, {e2e.get('dtype')}, batch {e2e.get('batch')}):")
        for b in ("triton", "torch"):
            v = e2e.get(b, {})
            if "decode_tokens_per_s" in v:
                lines.append(f"  {b:7s} decode {v['decode_tokens_per_s']:10.1f} tok/s")
            elif v:
                lines.append(f"  {b:7s} {v}")
        if "speedup_triton_vs_torch" in e2e:
            lines.append(
                f"  triton / torch: {e2e['speedup_triton_vs_torch']:.2f}x; identical sequences "
                f"{e2e.get('identical_sequences')}"
            )
        if "error" in e2e:
            lines.append(f"  error: {e2e['error']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parse(argv)
    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    import torch

    smoke = args.cpu_smoke or not torch.cuda.is_available()
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # read at launch by kvserve.kernels
        device = torch.device("cpu")
    else:
        device = torch.device("cuda")
    import triton

    clock = Clock(device)
    results = dict(
        device=torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({platform.processor() or platform.machine()}), Triton interpreter",
        mode="cpu-smoke" if smoke else "gpu",
        torch=torch.__version__,
        triton=triton.__version__,
        python=sys.version.split()[0],
    )
    results["checks"] = run_checks(device, smoke, args.seed)
    results["copy_GBps"] = copy_bandwidth(device, clock, smoke) / 1e9
    results["decode_grid"] = decode_grid(device, clock, smoke, results["copy_GBps"] * 1e9, deadline)
    if not args.skip_e2e:
        try:
            results["e2e"] = end_to_end(device, smoke, deadline)
        except Exception as exc:  # keep the kernel results even if the runtime cannot run this
            import traceback

            results["e2e"] = dict(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-2000:])
    results["wall_s"] = time.monotonic() - t0
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2, default=str)
    print(_table(results))
    print(f"wall {results['wall_s']:.1f}s; JSON: {args.out}")
    return 0 if all(c["ok"] for c in results["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())

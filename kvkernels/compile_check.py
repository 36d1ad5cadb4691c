"""Ahead-of-time compile of every kernel variant for a CUDA target, without a GPU.

Triton's front end, MLIR passes, LLVM and the bundled ``ptxas`` all run on the host, so the compiled (non
interpreter) path can be checked on a CPU-only machine: ``python -m kvserve.kernels.compile_check
--arch 90 --arch 80``. It catches what the interpreter cannot (unsupported constructs, loop-carried type
mismatches, illegal dot shapes, register/shared-memory blow-ups); it does not run anything.

Must run in a process where triton was imported *without* ``TRITON_INTERPRET`` (its ``@jit`` standard
library must be in compiled mode).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

# Argument types the wrappers pass (pointers by tensor dtype; ints that are not constexpr are i32 here:
# Triton specializes on value at launch, which does not change what has to compile).
_ATTN_PTRS = ("block_tables_ptr", "seq_lens_ptr", "cu_seqlens_q_ptr")


def _variants(arch: int):
    fp8s = ["fp8e5"] + (["fp8e4nv"] if arch >= 89 else [])
    out = []
    for cache in ["bf16", "fp32"] + fp8s:
        src = "fp32" if cache == "fp32" else "bf16"
        fp8 = cache.startswith("fp8")
        out.append(
            (
                "store",
                dict(
                    k_ptr="*" + src,
                    v_ptr="*" + src,
                    k_cache_ptr="*" + cache,
                    v_cache_ptr="*" + cache,
                    slot_ptr="*i64",
                    k_scale_ptr="*fp32",
                    v_scale_ptr="*fp32",
                ),
                dict(
                    NUM_KV_HEADS=8,
                    HEAD_DIM=128,
                    HEADS_PAD=8,
                    HEAD_DIM_PAD=128,
                    BLOCK_SIZE=16,
                    IS_FP8=fp8,
                    FP8_MAX=448.0 if cache == "fp8e4nv" else 57344.0,
                    FP8_MANT_BITS=3 if cache == "fp8e4nv" else 2,
                    FP8_MIN_EXP=-6 if cache == "fp8e4nv" else -14,
                    INTERPRET=False,
                ),
            )
        )
    # (q dtype, cache dtype, q_per_kv, head_dim, block_size, block_m)
    shapes = [
        ("bf16", "bf16", 4, 128, 16, 64),
        ("fp16", "fp16", 8, 80, 32, 64),
        ("bf16", "bf16", 1, 64, 16, 16),
        ("fp32", "fp32", 4, 128, 16, 64),
    ] + [("bf16", c, 4, 128, 16, 64) for c in fp8s]
    for q, cache, qpk, d, bs, bm in shapes:
        qpk_pad = 1 << (qpk - 1).bit_length()
        d_pad = max(16, 1 << (d - 1).bit_length())
        ptrs = dict(
            q_ptr="*" + q,
            k_cache_ptr="*" + cache,
            v_cache_ptr="*" + cache,
            k_scale_ptr="*fp32",
            v_scale_ptr="*fp32",
            sm_scale_log2="fp32",
            window="i32",
            softcap="fp32",
            **{p: "*i32" for p in _ATTN_PTRS},
        )
        common = dict(
            HEAD_DIM=d,
            HEAD_DIM_PAD=d_pad,
            BLOCK_SIZE=bs,
            TILE_N=32,
            IS_FP8=cache.startswith("fp8"),
            IEEE_DOT=q == "fp32",
            INTERPRET=False,
        )
        # Gemma 2's soft-cap is a compile-time switch: both sides for the 16-bit caches (the window is a
        # runtime int, compiled in every variant).
        for softcap in (False, True) if cache in ("bf16", "fp16") else (False,):
            out.append(
                (
                    "unified",
                    dict(ptrs, out_ptr="*" + q),
                    dict(
                        common,
                        Q_PER_KV=qpk,
                        Q_PER_KV_PAD=qpk_pad,
                        BLOCK_Q=bm // qpk_pad,
                        BLOCK_M=bm,
                        ROUND_BF16_OUT=False,
                        USE_SOFTCAP=softcap,
                    ),
                )
            )
            out.append(
                (
                    "split",
                    dict(ptrs, part_acc_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32"),
                    dict(common, Q_PER_KV=qpk, BLOCK_H=max(16, qpk_pad), NUM_SEGMENTS=8, USE_SOFTCAP=softcap),
                )
            )
        out.append(
            (
                "reduce",
                dict(
                    out_ptr="*" + q,
                    part_acc_ptr="*fp32",
                    part_m_ptr="*fp32",
                    part_l_ptr="*fp32",
                    seq_lens_ptr="*i32",
                    cu_seqlens_q_ptr="*i32",
                ),
                dict(HEAD_DIM=d, HEAD_DIM_PAD=d_pad, TILE_N=32, NUM_SEGMENTS=8, ROUND_BF16_OUT=False),
            )
        )
    return out


def compile_variants(arch: int = 90) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from . import attention, kv_store

    fns = {
        "store": kv_store._store_kv_kernel,
        "unified": attention._unified_attention_kernel,
        "split": attention._decode_segment_kernel,
        "reduce": attention._decode_reduce_kernel,
    }
    jits = {k: JITFunction(f) for k, f in fns.items()}
    results = []
    for kind, types, consts in _variants(arch):
        jf = jits[kind]
        sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in jf.arg_names}
        t0 = time.perf_counter()
        row = dict(
            kernel=kind,
            arch=f"sm{arch}",
            types={k: v for k, v in types.items() if "ptr" in k and "scale" not in k},
            consts={
                k: v
                for k, v in consts.items()
                if k in ("Q_PER_KV", "HEAD_DIM", "BLOCK_SIZE", "BLOCK_M", "NUM_SEGMENTS", "USE_SOFTCAP")
            },
        )
        try:
            k = triton.compile(ASTSource(jf, sig, consts), target=GPUTarget("cuda", arch, 32))
            row.update(ok=True, cubin_bytes=len(k.asm.get("cubin", b"")), shared_bytes=k.metadata.shared)
        except Exception as exc:  # report every failing variant, not just the first
            row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:2000]}")
        row["seconds"] = round(time.perf_counter() - t0, 2)
        results.append(row)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, action="append", help="CUDA compute capability x10 (default 90)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = [r for arch in (args.arch or [90]) for r in compile_variants(arch)]
    if args.json:
        print(json.dumps(rows, indent=1, default=str))
    else:
        for r in rows:
            status = f"ok  cubin {r['cubin_bytes']:7d} B  smem {r['shared_bytes']:6d} B" if r["ok"] else r["error"]
            print(f"{r['arch']:5s} {r['kernel']:8s} {json.dumps(r['types'])[:70]:70s} {status}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

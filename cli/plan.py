"""`kvserve plan`: how much KV cache fits, from the model's shape and the GPU's memory (the operator's math)."""
from __future__ import annotations

import argparse
import json

HELP = "Capacity plan: KV bytes/token, blocks, KV tokens and max concurrency for a model on a GPU"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="catalog entry, e.g. llama-3-70b (see --list)")
    parser.add_argument("--gpu", required=True, help="catalog entry or GFD product label, e.g. a100-80gb")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "fp8"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--gpu-memory-mib", type=int, help="override the GPU's memory")
    parser.add_argument("--activation-reserve-mib", type=int, help="override the estimated activation reserve")
    parser.add_argument("--runtime-overhead-mib", type=int, help="override the non-torch overhead")
    parser.add_argument("-o", "--output", choices=["table", "json"], default="table")


def _spec(args: argparse.Namespace) -> dict:
    engine = {"maxModelLen": args.max_model_len, "blockSize": args.block_size,
              "gpuMemoryUtilization": args.gpu_memory_utilization, "kvCacheDtype": args.kv_cache_dtype,
              "maxNumBatchedTokens": args.max_num_batched_tokens, "maxNumSeqs": args.max_num_seqs}
    if args.activation_reserve_mib is not None:
        engine["activationReserveMiB"] = args.activation_reserve_mib
    if args.runtime_overhead_mib is not None:
        engine["runtimeOverheadMiB"] = args.runtime_overhead_mib
    gpu = {"product": args.gpu, "tensorParallelSize": args.tensor_parallel_size}
    if args.gpu_memory_mib:
        gpu["memoryMiB"] = args.gpu_memory_mib
    return {"model": {"name": args.model, "uri": "file:///model", "dtype": args.dtype}, "gpu": gpu, "engine": engine}


def format_table(plan: dict) -> str:
    gb = lambda n: f"{n:,} B ({n / 1e9:.2f} GB, {n / 2**30:.2f} GiB)"  # noqa: E731
    rows = [
        ("fits", f"{plan['fits']} ({plan['reason']})"),
        ("KV bytes per token (model)", f"{plan['kv_bytes_per_token']:,} B ({plan['kv_bytes_per_token'] / 1024:g} KiB)"),
        ("KV bytes per token per GPU", f"{plan['kv_bytes_per_token_per_gpu']:,} B"),
        ("weights per GPU", gb(plan["weight_bytes_per_gpu"])),
        ("GPU memory", gb(plan["gpu_memory_bytes"])),
        ("budget per GPU (x utilization)", gb(plan["memory_budget_bytes_per_gpu"])),
        ("activation reserve per GPU", gb(plan["activation_reserve_bytes"])),
        ("runtime overhead per GPU", gb(plan["runtime_overhead_bytes"])),
        ("KV cache per GPU (--kv-cache-bytes)", gb(plan["kv_cache_bytes_per_gpu"])),
        ("blocks per GPU", f"{plan['num_blocks_per_gpu']:,} x {plan['block_size']} tokens"),
        ("KV tokens per replica", f"{plan['kv_tokens']:,}"),
        (f"max concurrency at {plan['max_model_len']:,} tokens", f"{plan['max_concurrency']:,}"),
        ("longest single sequence", f"{plan['max_model_len_fit']:,} tokens"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows) + f"\n{plan['message']}"


def run(args: argparse.Namespace) -> int:
    from kvserve.operator import spec as spec_mod

    try:
        resolved = spec_mod.resolve(_spec(args))
    except spec_mod.SpecError as exc:
        print(f"error: {exc.message}")
        return 2
    plan = resolved.plan.to_dict()
    print(json.dumps(plan, indent=2) if args.output == "json" else format_table(plan))
    return 0 if plan["fits"] else 1

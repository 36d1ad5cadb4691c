"""`kvserve bench lora`: one batch with 1, 4 and 16 LoRA adapters vs the base model, same requests, same
process (runtime/bench/lora.py)."""

from __future__ import annotations

import argparse

from kvserve.runtime.engine_args import positive_int

HELP = "multi-LoRA throughput: one batch using 1, 4 and 16 adapters vs the base model alone"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="local HF model dir (default: the built-in demo model)")
    parser.add_argument(
        "--adapters", type=positive_int, nargs="+", default=[1, 4, 16], help="distinct adapters per batch, per row"
    )
    parser.add_argument("--num-requests", type=positive_int, default=32, help="requests in the batch")
    parser.add_argument("--prompt-len", type=positive_int, default=64, help="prompt tokens per request")
    parser.add_argument("--max-tokens", type=positive_int, default=32, help="output tokens per request")
    parser.add_argument("--rank", type=positive_int, default=16, help="the adapters' rank (also --max-lora-rank)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="interleaved rounds (medians)")
    parser.add_argument("--dtype", default=None, help="weights dtype (default: the model's)")
    parser.add_argument("--seed", type=int, default=0, help="workload and adapter weights seed")
    parser.add_argument("--json-out", default=None, help="also write the table as JSON to this file")


def run(args: argparse.Namespace) -> int:
    from kvserve.cli.errors import CLIError
    from kvserve.runtime.bench.lora import main

    if args.num_requests < max(args.adapters):
        raise CLIError(f"--num-requests ({args.num_requests}) must be >= the most --adapters ({max(args.adapters)})")
    model = args.model
    if model is None:
        from kvserve.runtime.demo_model import ensure_demo_model

        model = str(ensure_demo_model())
    kwargs = {"dtype": args.dtype} if args.dtype else {}
    main(
        model,
        adapter_counts=tuple(args.adapters),
        num_requests=args.num_requests,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
        rank=args.rank,
        rounds=args.rounds,
        seed=args.seed,
        json_out=args.json_out,
        **kwargs,
    )
    return 0

"""`kvserve bench peaky`: offline generation on a peaky-attention random model vs the same model with flat
attention, one process, ABBA (runtime/bench/peaky.py)."""

from __future__ import annotations

import argparse

HELP = (
    "value-dependent slowdown check: offline tok/s of a random 125M Llama with peaky attention (q/k scaled) "
    "vs the flat original, same process, ABBA; goal peaky >= 0.9x flat"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=32, help="requests per run")
    parser.add_argument(
        "--prompt-len", type=int, nargs=2, default=(128, 512), metavar=("MIN", "MAX"), help="prompt tokens"
    )
    parser.add_argument(
        "--output-len", type=int, nargs=2, default=(32, 96), metavar=("MIN", "MAX"), help="output tokens"
    )
    parser.add_argument(
        "--qk-scale", type=float, default=25.0, help="factor on the peaky copy's q_proj and k_proj weights"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights dtype")
    parser.add_argument("--rounds", type=int, default=1, help="ABBA rounds (each model runs 2x per round)")
    parser.add_argument("--seed", type=int, default=0, help="weights and workload seed")
    parser.add_argument("--json-out", default=None, help="also write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    from kvserve.runtime.bench.peaky import main

    report = main(
        num_requests=args.num_requests,
        prompt_range=tuple(args.prompt_len),
        output_range=tuple(args.output_len),
        qk_scale=args.qk_scale,
        dtype=args.dtype,
        rounds=args.rounds,
        seed=args.seed,
        json_out=args.json_out,
    )
    return 0 if report["goal_met"] else 1

"""`kvserve bench spec`: speculative decoding on vs off, same requests, same process (runtime/bench/spec_decode.py)."""

from __future__ import annotations

import argparse
import json

from kvserve.cli.errors import CLIError

HELP = "speculative decoding vs plain decoding: tokens/s and time per output token at 1, 8 and 64 streams"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="local HF model dir (default: the built-in demo model)")
    parser.add_argument(
        "--speculative-config",
        default=None,
        help='vLLM\'s JSON (default: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 4})',
    )
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 64], help="concurrent requests per run")
    parser.add_argument(
        "--workloads", nargs="+", default=["repetitive", "random"], choices=("repetitive", "random"), help="prompts"
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved plain/speculative rounds (medians)")
    parser.add_argument("--dtype", default=None, help="weights dtype (default: the model's)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the prompts")
    parser.add_argument("--json-out", default=None, help="also write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    from kvserve.runtime.bench.spec_decode import main

    spec = None
    if args.speculative_config:
        try:
            spec = json.loads(args.speculative_config)
        except json.JSONDecodeError as exc:
            raise CLIError(f"--speculative-config is not valid JSON: {exc}") from None
    model = args.model
    if model is None:
        from kvserve.runtime.demo_model import ensure_demo_model

        model = str(ensure_demo_model())
    kwargs = {"dtype": args.dtype} if args.dtype else {}
    main(
        model,
        spec,
        streams=tuple(args.streams),
        workloads=tuple(args.workloads),
        max_tokens=args.max_tokens,
        rounds=args.rounds,
        seed=args.seed,
        json_out=args.json_out,
        **kwargs,
    )
    return 0

"""`kvserve bench step`: host time vs model time per decode step at N running decodes."""

from __future__ import annotations

import argparse

from kvserve.runtime import engine_args

HELP = "per-step host overhead: scheduler, input preparation and output bookkeeping vs model time"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="local HF model dir or MODEL.gguf (default: SmolLM2-135M-Instruct, as `kvserve serve`; offline the demo)",
    )
    parser.add_argument(
        "--random-prompts", action="store_true", help="random token ids instead of chat-templated real text"
    )
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[64, 256, 512], help="numbers of running decodes to measure at"
    )
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per running request")
    parser.add_argument("--num-steps", type=int, default=20, help="measured decode steps per batch size")
    parser.add_argument("--warmup-steps", type=int, default=3, help="unmeasured decode steps first")
    parser.add_argument(
        "--block-size", type=int, default=engine_args.default("block_size"), help="KV block size in tokens"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed of the prompts")
    parser.add_argument("--device", default=None, help="e.g. cuda (default: the engine's default)")
    parser.add_argument("--dtype", default=None, help="weights dtype (default: the model's)")
    parser.add_argument(
        "--load-format",
        default=None,
        choices=("auto", "dummy"),
        help="dummy: random weights from config.json alone (a model shape without its checkpoint)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="replay decode steps from CUDA graphs (captured at each measured batch size)",
    )
    parser.add_argument("--json-out", default=None, help="also write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    from kvserve.runtime.bench.step import main

    engine_kwargs = {
        name: value
        for name, value in (("device", args.device), ("dtype", args.dtype), ("load_format", args.load_format))
        if value
    }
    if args.cuda_graphs:
        engine_kwargs["cuda_graphs"] = True
    main(
        model_dir=args.model,
        batch_sizes=tuple(args.batch_sizes),
        prompt_len=args.prompt_len,
        num_steps=args.num_steps,
        warmup_steps=args.warmup_steps,
        block_size=args.block_size,
        seed=args.seed,
        json_out=args.json_out,
        random_prompts=args.random_prompts,
        **engine_kwargs,
    )
    return 0

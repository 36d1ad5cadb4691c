"""`kvserve bench throughput`: offline throughput vs transformers generate on SmolLM2-135M-Instruct (or
--random-model)."""

from __future__ import annotations

import argparse

from kvserve.runtime import capacity, engine_args

HELP = "offline throughput benchmark against transformers generate (same model, same requests, one run)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=32, help="requests in the workload")
    parser.add_argument(
        "--prompt-len",
        type=int,
        nargs=2,
        default=(16, 256),
        metavar=("MIN", "MAX"),
        help="prompt tokens, uniform in [MIN, MAX]",
    )
    parser.add_argument(
        "--output-len",
        type=int,
        nargs=2,
        default=(16, 128),
        metavar=("MIN", "MAX"),
        help="output tokens, uniform in [MIN, MAX]",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed of the workload")
    parser.add_argument("--hf-batch-size", type=int, default=8, help="transformers generate batch size (the baseline)")
    parser.add_argument("--skip-hf", action="store_true", help="do not run the transformers baseline")
    parser.add_argument(
        "--model",
        default=None,
        help="local HF model dir (default: SmolLM2-135M-Instruct, the default model, dequantised to --dtype "
        "safetensors, with chat-templated real-text prompts)",
    )
    parser.add_argument(
        "--random-model",
        action="store_true",
        help="build the random-weight 125M Llama instead (random token-id prompts; shape by the flags below)",
    )
    parser.add_argument(
        "--random-prompts", action="store_true", help="random token ids instead of chat-templated real text"
    )
    parser.add_argument("--hidden-size", type=int, default=None, help="with --random-model: shape of the built model")
    parser.add_argument("--num-layers", type=int, default=None, help="with --random-model: shape of the built model")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="with --random-model: vocab of the built model; otherwise caps random prompts' token ids",
    )
    parser.add_argument(
        "--block-size", type=int, default=engine_args.default("block_size"), help="KV block size in tokens"
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    parser.add_argument(
        "--max-num-seqs", type=int, default=None, help="running sequences at most (default: every request)"
    )
    parser.add_argument(
        "--kv-cache-bytes", type=int, default=None, help="KV cache budget in bytes (default: sized by the engine)"
    )
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks, overriding --kv-cache-bytes")
    parser.add_argument(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="turn automatic prefix caching off",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=engine_args.default("tensor_parallel_size"),
        help="tensor-parallel ranks",
    )
    parser.add_argument(
        "--dtype", default="float32", choices=capacity.FLOAT_DTYPES, help="weights/activations dtype for both engines"
    )
    parser.add_argument("--json-out", default=None, help="also write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    from kvserve.runtime.bench.throughput import main

    if args.model and args.random_model:
        raise SystemExit("--model and --random-model exclude each other")
    if not args.random_model and (args.hidden_size or args.num_layers):
        raise SystemExit("--hidden-size / --num-layers shape the --random-model; a real model's config.json does")
    shape = {
        k: v
        for k, v in (
            ("hidden_size", args.hidden_size),
            ("num_hidden_layers", args.num_layers),
            ("vocab_size", args.vocab_size),
        )
        if v is not None
    }
    engine_kwargs = dict(
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    for key in ("max_num_seqs", "kv_cache_bytes", "num_kv_blocks"):
        if getattr(args, key) is not None:
            engine_kwargs[key] = getattr(args, key)
    main(
        num_requests=args.num_requests,
        prompt_range=tuple(args.prompt_len),
        output_range=tuple(args.output_len),
        seed=args.seed,
        hf_batch_size=args.hf_batch_size,
        skip_hf=args.skip_hf,
        model_dir=args.model,
        shape=shape,
        json_out=args.json_out,
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=args.dtype,
        random_model=args.random_model,
        random_prompts=args.random_prompts,
        **engine_kwargs,
    )
    return 0

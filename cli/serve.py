"""`kvserve serve [MODEL_DIR]`: the OpenAI-compatible server. Flags follow `vllm serve` where the concept is
the same. With no MODEL_DIR it serves the built-in demo model (random weights, built offline on first use)."""
from __future__ import annotations

import argparse
import os
import re
import sys

HELP = "run the OpenAI-compatible server (no MODEL_DIR: the built-in random-weights demo model)"

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """`1073741824`, `512MiB`, `1G`, `1.5GB` -> bytes (binary multiples: a KV budget is a memory size)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (examples: 536870912, 512MiB, 2G)")
    value, unit = float(match.group(1)), match.group(2).lower()
    return int(value * 1024 ** "kmgt".find(unit) * 1024) if unit else int(value)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", nargs="?", metavar="MODEL_DIR",
                        help="HF-format model directory (config.json, *.safetensors, tokenizer). "
                             "Omit to serve the built-in demo model with random weights.")
    parser.add_argument("--host", default="0.0.0.0", help="bind address (default: all interfaces)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) clients send in `model` (default: MODEL_DIR as given, or "
                             "kvserve-demo-random-weights)")
    parser.add_argument("--max-model-len", type=_positive_int, default=None,
                        help="context length (default: the model's max_position_embeddings)")
    parser.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV-cache block")
    parser.add_argument("--max-num-seqs", type=_positive_int, default=256, help="max sequences per step")
    parser.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                        help="token budget per step (default: the engine's)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="automatic prefix caching (default: on)")
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                        help="split long prompts across steps (default: on)")
    parser.add_argument("--long-prefill-token-threshold", type=int, default=0,
                        help="with chunked prefill: at most this many prompt tokens of one request per step "
                             "(0: only the step budget limits it); keeps decode steps short among long prompts")
    parser.add_argument("--kv-cache-bytes", type=parse_bytes, default=None,
                        help="KV-cache budget, e.g. 512MiB (CPU; default: the engine's). GPUs size it by profiling.")
    parser.add_argument("--num-kv-blocks", type=_positive_int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                        help="KV cache element type; fp8 (= fp8_e4m3) halves KV bytes per token vs 16-bit "
                             "(per-tensor scale 1.0)")
    parser.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                        help="when the KV cache is full: drop the victim's KV and recompute, or swap it to host RAM")
    parser.add_argument("--swap-space", type=parse_bytes, default=None, dest="swap_space_bytes",
                        help="host RAM for --preemption-mode swap, in bytes (suffixes like 4GiB accepted)")
    parser.add_argument("--dtype", default="auto", help="weights/activations dtype: auto, float32, float16, bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1,
                        help="shard the model over this many worker processes / GPUs (torch.distributed: NCCL on "
                             "CUDA, gloo on CPU); KV budgets are per rank")
    parser.add_argument("--attention-backend", default=None, help="torch or triton (default: by device)")
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` on /v1/* (also read from KVSERVE_API_KEY)")
    parser.add_argument("--max-queue-len", type=_positive_int, default=None,
                        help="answer 429 + Retry-After when this many requests already wait (default: unbounded)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds to finish in-flight requests after SIGTERM before aborting them")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("kvserve.serve")

    from kvserve.runtime.demo_model import DEMO_MODEL_ID, ensure_demo_model, is_demo_model_dir
    from kvserve.runtime.server.api_server import run_server
    from kvserve.runtime.server.app import ServerConfig

    if args.model_dir is None:
        model_dir = str(ensure_demo_model())
        served = args.served_model_name or [DEMO_MODEL_ID]
        log.warning("no MODEL_DIR given: serving the built-in demo model %r from %s. Its weights are RANDOM: "
                    "the output is gibberish. Pass a model directory to serve a real model.", served[0], model_dir)
    else:
        model_dir = args.model_dir
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            print(f"kvserve serve: MODEL_DIR {model_dir!r} is not a model directory (no config.json)", file=sys.stderr)
            return 2
        served = args.served_model_name or [model_dir]
    random_weights = is_demo_model_dir(model_dir)
    if args.drain_timeout < 0:
        print("kvserve serve: --drain-timeout must be >= 0", file=sys.stderr)
        return 2

    engine_kwargs = dict(
        block_size=args.block_size, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold, kv_cache_bytes=args.kv_cache_bytes,
        num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization, dtype=args.dtype,
        seed=args.seed, attention_backend=args.attention_backend, tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_dtype=args.kv_cache_dtype, preemption_mode=args.preemption_mode,
        swap_space_bytes=args.swap_space_bytes,
    )

    def load_engine():
        from kvserve.runtime.engine.llm_engine import LLMEngine

        return LLMEngine.from_kwargs(model=model_dir, **engine_kwargs)

    config = ServerConfig(
        served_model_names=served, model_dir=model_dir,
        api_key=args.api_key or os.environ.get("KVSERVE_API_KEY") or None,
        max_queue_len=args.max_queue_len, drain_timeout_s=args.drain_timeout, random_weights=random_weights,
    )
    log.info("serving %s as %s on http://%s:%d (loading the model; /health is 503 until ready)",
             model_dir, ", ".join(served), args.host, args.port)
    return run_server(config, host=args.host, port=args.port, engine_factory=load_engine,
                      log_level=args.log_level)

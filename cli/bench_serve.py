"""`kvserve bench serve`: a serving benchmark modelled on `vllm bench serve` (kvserve.runtime.bench.serve)."""

from __future__ import annotations

import argparse

HELP = "serving benchmark (vllm bench serve style): arrivals, TTFT/TPOT/ITL, goodput; on/off comparisons"

WORKLOADS = ("random", "shared-prefix", "long-prompt")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to benchmark")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument("--api-key", default=None, help="bearer token sent to the server (its --api-key)")
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="random",
        help="which prompts: random lengths, a shared prefix, or long prompts beside streams",
    )
    parser.add_argument(
        "--compare",
        choices=("prefix-caching", "chunked-prefill", "served-vs-offline"),
        default=None,
        help="launch `kvserve serve` with the feature on and off and run the matching workload "
        "(shared-prefix / long-prompt) on each; served-vs-offline: the random workload "
        "offline, then served with the engine core in the server process and in its own "
        "process, with served/offline ratios",
    )
    parser.add_argument(
        "--model-dir",
        default=None,
        help="with --compare: MODEL_DIR for the launched servers (and the offline run) "
        "(default: SmolLM2-135M-Instruct, as `kvserve serve` with no model; offline the random demo)",
    )
    parser.add_argument("--serve-args", default="", help="with --compare: extra `kvserve serve` flags for both runs")
    parser.add_argument("--on-args", default="", help="with --compare: extra flags for the feature-on run only")
    parser.add_argument("--off-args", default="", help="with --compare: extra flags for the feature-off run only")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="with --compare served-vs-offline: run the two served variants this many times, in "
        "ABBA order (a shared machine's load drifts)",
    )
    parser.add_argument(
        "--before-python",
        default=None,
        help="with --compare served-vs-offline: the python of another kvserve install (e.g. main's "
        "venv) whose `kvserve serve` is the before run, instead of --inprocess-engine",
    )
    parser.add_argument(
        "--api-server-counts",
        default="1",
        help="with --compare served-vs-offline: comma-separated `--api-server-count` values for the "
        "core-process server, each a served variant in the same ABBA run (e.g. 1,2); the "
        "goal is judged on the first",
    )
    parser.add_argument(
        "--prompts",
        choices=("text", "random"),
        default="text",
        help="text: chat-templated real text (runtime/bench/real_prompts.py), tokenized by the server's /tokenize "
        "(vLLM's servers have it too), cut to each length; random: random token ids",
    )
    parser.add_argument("--num-prompts", type=int, default=64, help="requests to send")
    parser.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s; inf sends everything at t=0 (burst)"
    )
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1.0 = Poisson")
    parser.add_argument(
        "--max-concurrency", type=int, default=None, help="requests in flight at most (default: all at once)"
    )
    parser.add_argument("--input-len", type=int, default=256, help="random: mean prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens (random, shared-prefix)")
    parser.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths in [L(1-r), L(1+r)]")
    parser.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: shared tokens")
    parser.add_argument("--suffix-len", type=int, default=32, help="shared-prefix: unique tokens per request")
    parser.add_argument("--long-prompt-len", type=int, default=4096, help="long-prompt: tokens per long prompt")
    parser.add_argument("--num-long-prompts", type=int, default=4, help="long-prompt: long prompts sent")
    parser.add_argument("--long-output-len", type=int, default=4, help="long-prompt: output tokens per long prompt")
    parser.add_argument("--num-streams", type=int, default=8, help="long-prompt: background streams")
    parser.add_argument("--stream-output-len", type=int, default=256, help="long-prompt: tokens per stream")
    parser.add_argument(
        "--stream-prompt-len", type=int, default=32, help="long-prompt: prompt tokens per background stream"
    )
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000 (milliseconds)",
    )
    parser.add_argument("--percentiles", default="50,90,99", help="reported percentiles")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the workload")
    parser.add_argument("--result-json", default=None, help="write results here")
    parser.add_argument("--plot", default=None, help="write a PNG here")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")


# ------------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    from kvserve.runtime.bench.serve import main

    return main(args)

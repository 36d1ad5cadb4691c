"""`kvserve bench serve`: a serving benchmark modelled on `vllm bench serve`.

Sends streamed /v1/completions requests (prompts as token ids, so lengths are exact; `ignore_eos` so output
lengths are exact) with Poisson, gamma (burstiness) or burst arrivals, and reports request / output-token
throughput, TTFT, TPOT, ITL and E2EL (mean, median, std, percentiles) and goodput under SLOs, like vLLM:
TTFT = first streamed chunk; ITL = gaps between chunks; TPOT = (E2EL - TTFT) / (output tokens - 1).

Workloads:
  random         random prompt and output lengths (input_len, output_len, range_ratio)
  shared-prefix  every prompt starts with the same prefix (default 1024 tokens) plus a short unique suffix
  long-prompt    background streams decode steadily; phase 1 measures their steady-state ITL alone, phase 2
                 adds long prompts (default 4096 tokens) arriving among them and measures p99 ITL

`--compare served-vs-offline` (served_vs_offline.py) runs the random workload offline (in-process
engine) and through `kvserve serve` with the engine core in the server process and in its own process, and
prints the served/offline ratios.

Against a running server (--base-url), or `--compare prefix-caching|chunked-prefill`, which launches
`kvserve serve` twice on a free local port (feature on, then off; --serve-args passed to both) and runs
the matching workload on each. Writes JSON (--result-json) and a PNG (--plot).
"""

from __future__ import annotations

import argparse

from kvserve.runtime.bench.serve_client import LaunchedServer, fmt, print_result, run_async, run_workload


def main(args: argparse.Namespace) -> int:
    import json
    import logging

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        slos = _parse_goodput(args.goodput)
    except ValueError as exc:
        print(f"kvserve bench serve: --goodput: {exc}")
        return 2
    if args.compare == "served-vs-offline":
        from kvserve.runtime.bench.served_vs_offline import compare

        result = compare(args, slos)
    elif args.compare:
        result = _compare(args, slos)
    else:
        result = run_async(run_workload(args, args.base_url, slos))
        print_result(result)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.result_json}")
    if args.plot:
        _plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _parse_goodput(items: list[str] | None) -> dict[str, float]:
    slos = {}
    for item in items or []:
        key, _, ms = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not ms:
            raise ValueError(f"expected ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        slos[key] = float(ms) / 1000.0
    return slos


def _compare(args: argparse.Namespace, slos: dict[str, float]) -> dict:
    import shlex

    feature = args.compare
    args.workload = "shared-prefix" if feature == "prefix-caching" else "long-prompt"
    flag = "--enable-prefix-caching" if feature == "prefix-caching" else "--enable-chunked-prefill"
    runs = {}
    for state, extra in (("on", args.on_args), ("off", args.off_args)):
        serve_args = [flag if state == "on" else flag.replace("--enable", "--no-enable")]
        serve_args += shlex.split(args.serve_args) + shlex.split(extra)
        with LaunchedServer(args.model_dir, serve_args) as server:
            print(f"== {feature} {state}: kvserve serve {' '.join(serve_args)}")
            runs[state] = run_async(run_workload(args, server.base_url, slos, label=f"{feature} {state}"))
            runs[state]["serve_args"] = serve_args
            print_result(runs[state])
    on, off = runs["on"]["metrics"], runs["off"]["metrics"]
    if feature == "prefix-caching":
        summary = {
            "mean_ttft_ms_on": on["mean_ttft_ms"],
            "mean_ttft_ms_off": off["mean_ttft_ms"],
            "median_ttft_ms_on": on["median_ttft_ms"],
            "median_ttft_ms_off": off["median_ttft_ms"],
            "ttft_ratio_on_over_off": on["mean_ttft_ms"] / off["mean_ttft_ms"] if off["mean_ttft_ms"] else None,
            "ttft_reduction_pct": 100 * (1 - on["mean_ttft_ms"] / off["mean_ttft_ms"]) if off["mean_ttft_ms"] else None,
            "goal": "TTFT with the shared prefix >= 85% lower with prefix caching on",
        }
        summary["goal_met"] = summary["ttft_reduction_pct"] is not None and summary["ttft_reduction_pct"] >= 85
    else:
        summary = {
            "steady_state_itl_ms_on": on["steady_state_itl_ms"],
            "steady_state_itl_ms_off": off["steady_state_itl_ms"],
            "p99_itl_ms_on": on["p99_itl_ms_with_long_prompts"],
            "p99_itl_ms_off": off["p99_itl_ms_with_long_prompts"],
            "p99_over_steady_on": on["p99_over_steady"],
            "p99_over_steady_off": off["p99_over_steady"],
            "goal": "p99 ITL with chunked prefill <= 2x the steady-state ITL",
        }
        summary["goal_met"] = on["p99_over_steady"] is not None and on["p99_over_steady"] <= 2.0
    print(f"== {feature}: " + ", ".join(f"{k}={fmt(v)}" for k, v in summary.items()))
    return {"compare": feature, "summary": summary, "runs": runs}


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"] if "runs" in result else {"": result}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for label, run in runs.items():
        reqs = [r for r in run["requests"] if r["success"]]
        streams = [r for r in reqs if r["tag"] != "long"]
        ttfts = sorted(r["ttft_s"] * 1000 for r in reqs if r["tag"] != "stream") or sorted(
            r["ttft_s"] * 1000 for r in reqs
        )
        itls = sorted(x * 1000 for r in streams for x in r["itl_s"])
        name = label or run["workload"]
        axes[0].plot(ttfts, [i / max(1, len(ttfts) - 1) for i in range(len(ttfts))], label=name)
        axes[1].plot(itls, [i / max(1, len(itls) - 1) for i in range(len(itls))], label=name)
        # output tokens per 0.5 s bin over time
        times = sorted(t for r in reqs for t in r["chunk_s"])
        if times:
            width = 0.5
            nbins = int(times[-1] / width) + 1
            counts = [0] * nbins
            for t in times:
                counts[int(t / width)] += 1
            axes[2].plot([i * width for i in range(nbins)], [c / width for c in counts], label=name)
        for r in run["requests"]:
            if r["tag"] == "long" and r["ttft_s"] is not None:
                axes[2].axvline(r["start_s"], color="grey", alpha=0.3, linewidth=0.8)
    workload = next(iter(runs.values()))["workload"]
    axes[0].set(
        title="TTFT CDF" + (" (long prompts)" if workload == "long-prompt" else ""), xlabel="ms", ylabel="fraction"
    )
    axes[1].set(title="ITL CDF (streams)", xlabel="ms", xscale="log")
    axes[2].set(title="streamed chunks/s (grey: long prompt arrivals)", xlabel="s since start")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(result.get("compare") or result["workload"])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

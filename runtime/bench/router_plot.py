"""`kvserve bench router --plot`: the runs' TTFT CDFs, hit rates and the kill run's timeline in one PNG."""

from __future__ import annotations

import statistics


def group(runs: dict[str, dict], name: str) -> list[dict]:
    """The runs of one kind (repetitions are keyed name#1, name#2, ...)."""
    return [run for key, run in runs.items() if key.split("#")[0] == name]


def plot(runs: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    colors = {
        "single": "grey",
        "router": "tab:blue",
        "router-events": "tab:purple",
        "random": "tab:orange",
        "random-proxy": "tab:green",
    }
    names = [n for n in colors if group(runs, n)]
    for name in names:  # pooled over repetitions
        ttfts = sorted(r["ttft_s"] * 1000 for run in group(runs, name) for r in run["records"] if r["ok"])
        axes[0].plot(ttfts, [i / max(1, len(ttfts) - 1) for i in range(len(ttfts))], label=name, color=colors[name])
    axes[0].set(title="TTFT CDF (all repetitions)", xlabel="ms", ylabel="fraction of requests", xscale="log")
    for i, name in enumerate(names):
        rates = [run.get("prefix_cache_hit_rate", 0) for run in group(runs, name)]
        axes[1].scatter([i] * len(rates), rates, color=colors[name], zorder=3)
        axes[1].bar(i, statistics.median(rates), color=colors[name], alpha=0.5)
    axes[1].set_xticks(range(len(names)), names)
    axes[1].set(title="cluster prefix-cache hit rate (bar: median, dots: runs)", ylim=(0, 1))
    if "kill" in runs:
        kill = runs["kill"]
        for ok, color, label in ((True, "tab:blue", "completed"), (False, "tab:red", "failed mid-stream")):
            pts = [(r["start_s"], (r["ttft_s"] or 0) * 1000) for r in kill["records"] if r["ok"] is ok]
            if pts:
                axes[2].scatter(*zip(*pts), s=10, color=color, label=label)
        if kill.get("killed"):
            axes[2].axvline(kill["killed"]["at_s"], color="black", linestyle="--", label="replica killed")
        axes[2].set(
            title="router with a replica killed: TTFT per request", xlabel="request start (s)", ylabel="TTFT (ms)"
        )
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

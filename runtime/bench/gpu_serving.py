#!/usr/bin/env python
"""GPU check-and-benchmark for the serving path (issue 10 item 6): decode CUDA graphs, host overhead per step,
served vs offline. One command, sized to finish in ~7 minutes on one H200 (--budget-s stops starting new
sections after that).

On CUDA:
  1. graphs: greedy tokens with --cuda-graphs equal the eager engine's (fp32 random Llama with peaked logits,
     48 prompts whose outputs end at different steps, so decode batches shrink through the capture ladder
     and pad); exit status 1 if any sequence differs;
  2. step: `kvserve bench step` on a Llama-3-8B-shaped random bf16 model (load_format="dummy": no checkpoint)
     at 64/256/512 running decodes, eager vs CUDA graphs: model time, core host time, whole step;
  3. served vs offline: `kvserve bench serve --compare served-vs-offline` on the same 8B shape, 256 streams x
     128/128 tokens, eager and with --cuda-graphs: served/offline throughput and TPOT / offline step.
Every engine is built in a child process of its own (graph check: one per mode; step: one per mode and
batch size), so one engine's device memory never crowds the next. It writes JSON (--out) after every section
and prints a table.

Without CUDA, or with --cpu-smoke: TRITON_INTERPRET=1, graphs emulated on CPU (worker/cuda_graphs.py),
tiny sizes, and the served comparison without graphs (the server process cannot emulate them) -- the
timings are meaningless; the point is that every code path of the script runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time

from kvserve.runtime.bench.gpu_kernels import LLAMA3_8B
from kvserve.runtime.bench.gpu_kernels import TINY_MODEL as TINY

# Graph check model: big enough that a wrong row or stale buffer shows, small enough to run eagerly in seconds.
CHECK = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=2048,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    initializer_range=0.2,
)


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes under the Triton interpreter on CPU")
    p.add_argument("--out", default="gpu_serving_results.json")
    p.add_argument("--budget-s", type=float, default=420.0, help="start no new section after this many seconds")
    p.add_argument("--skip", nargs="*", default=[], choices=("graphs", "step", "served"))
    # Internal: one piece of a section in a child process (below), so that every engine's device memory is
    # surely released before the next one is built.
    p.add_argument("--piece", choices=("graphs", "step"), help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=("eager", "graphs"), help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _child(piece: str, mode: str, smoke: bool, model_dir: str, size: int | None = None) -> dict:
    """Run one piece in a fresh interpreter; its JSON result (or the error it printed)."""
    out = tempfile.mktemp(suffix=".json")
    cmd = (
        [
            sys.executable,
            os.path.abspath(__file__),
            "--piece",
            piece,
            "--mode",
            mode,
            "--model-dir",
            model_dir,
            "--out",
            out,
        ]
        + (["--cpu-smoke"] if smoke else [])
        + (["--size", str(size)] if size else [])
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(
            f"{piece} {mode} {size or ''} failed (exit {proc.returncode}): {(proc.stdout + proc.stderr)[-3000:]}"
        )
    with open(out) as f:
        return json.load(f)


def _shape_dir(shape: dict, dtype: str) -> str:
    """config.json + a word tokenizer, no weights (load_format="dummy" makes them on the device)."""
    from kvserve.runtime.models.synthetic import make_shape_dir

    return make_shape_dir(tempfile.mkdtemp(prefix="kvserve-shape-"), "LlamaForCausalLM", dtype, **shape)


# -- 1. graphs give the eager engine's tokens ---------------------------------------------------------
def _graph_workload(smoke: bool):
    rng = random.Random(0)
    vocab = (TINY if smoke else CHECK)["vocab_size"]
    num = 5 if smoke else 48
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(4, 40 if smoke else 300))] for _ in range(num)]
    max_tokens = [rng.randrange(2, 8 if smoke else 64) for _ in range(num)]
    return prompts, max_tokens


def graph_piece(mode: str, smoke: bool, model_dir: str) -> dict:
    """One engine (eager or graphs) on the check workload: its tokens and timings."""
    from kvserve.runtime import LLM, SamplingParams

    device = "cpu" if smoke else "cuda"
    prompts, max_tokens = _graph_workload(smoke)
    kw = dict(
        max_model_len=512,
        attention_backend="triton",
        device=device,
        max_num_seqs=4 if smoke else 64,
        max_num_batched_tokens=256 if smoke else 2048,
    )
    kw.update(num_kv_blocks=64) if smoke else kw.update(kv_cache_bytes=4 << 30)
    if mode == "graphs":
        kw["cuda_graphs"] = True
    t = time.perf_counter()
    llm = LLM(model_dir, **kw)
    result = dict(engine_start_s=time.perf_counter() - t, max_num_seqs=kw["max_num_seqs"])
    t = time.perf_counter()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens],
        use_tqdm=False,
    )
    result.update(generate_s=time.perf_counter() - t, tokens=[o.outputs[0].token_ids for o in outs])
    graphs = llm.engine.executor.runner.decode_graphs
    if graphs is not None:
        result.update(
            capture_sizes=list(graphs.capture_sizes),
            capture_s=graphs.capture_s,
            replays=graphs.num_replays,
            graph_memory_mib=graphs.memory_bytes / 2**20,
        )
    return result


def graph_check(smoke: bool) -> dict:
    from kvserve.runtime.models.synthetic import make_random_model_dir

    model_dir = tempfile.mkdtemp(prefix="kvserve-graphcheck-")
    make_random_model_dir(model_dir, "LlamaForCausalLM", seed=3, dtype="float32", **(TINY if smoke else CHECK))
    result = {mode: _child("graphs", mode, smoke, model_dir) for mode in ("eager", "graphs")}
    tokens = {mode: result[mode].pop("tokens") for mode in result}
    num = len(tokens["eager"])
    same = sum(a == b for a, b in zip(tokens["eager"], tokens["graphs"]))
    result.update(prompts=num, identical_sequences=f"{same}/{num}")
    result["ok"] = same == num and result["graphs"].get("replays", 0) > 0
    return result


# -- 2. host vs model time per decode step -------------------------------------------------------------
def step_piece(mode: str, smoke: bool, model_dir: str, size: int) -> dict:
    from kvserve.runtime.bench import step as bench_step

    kw = dict(
        device="cpu" if smoke else "cuda",
        dtype="float32" if smoke else "bfloat16",
        load_format="dummy",
        attention_backend="triton",
    )
    if mode == "graphs":
        kw["cuda_graphs"] = True
    r = bench_step.main(
        model_dir,
        batch_sizes=(size,),
        prompt_len=16 if smoke else 128,
        num_steps=3 if smoke else 20,
        warmup_steps=1 if smoke else 3,
        **kw,
    )[0]
    return dict(
        num_decodes=r.num_decodes,
        model_ms=r.model_ms,
        core_host_ms=r.core_host_ms,
        front_end_ms=r.front_end_ms,
        step_ms=r.step_ms,
    )


def step_bench(smoke: bool, deadline: float) -> dict:
    shape, dtype = (TINY, "float32") if smoke else (LLAMA3_8B, "bfloat16")
    model_dir = _shape_dir(shape, dtype)
    sizes = (2,) if smoke else (64, 256, 512)  # smoke: one size (each is a child per mode)
    out = {"model": "tiny" if smoke else "Llama-3-8B shape, random bf16 weights", "batch_sizes": list(sizes)}
    for mode in ("eager", "graphs"):
        out[mode] = [
            _child("step", mode, smoke, model_dir, n)
            if time.monotonic() < deadline
            else dict(num_decodes=n, skipped="time budget")
            for n in sizes
        ]
    return out


# -- 3. served vs offline -------------------------------------------------------------------------------
def served_vs_offline(smoke: bool, deadline: float) -> dict:
    shape, dtype = (TINY, "float32") if smoke else (LLAMA3_8B, "bfloat16")
    model_dir = _shape_dir(shape, dtype)
    n, in_len, out_len = (8, 16, 8) if smoke else (256, 128, 128)
    base = f"--load-format dummy --dtype {dtype} --max-num-seqs {max(n, 8)}"
    if smoke:
        base += " --num-kv-blocks 64 --max-model-len 256"
    else:  # explicit (256 x 256 tokens x 128 KiB = 8 GiB needed): the bench's own offline engine may still hold
        base += " --kv-cache-bytes 16GiB"  # its memory while a server starts, and a profiled share would not fit
    variants = {"eager": base} if smoke else {"eager": base, "graphs": base + " --cuda-graphs"}
    out = {
        "model": "tiny" if smoke else "Llama-3-8B shape, random bf16 weights",
        "prompts": n,
        "input_len": in_len,
        "output_len": out_len,
    }
    for name, serve_args in variants.items():
        if time.monotonic() > deadline:
            out[name] = dict(skipped="time budget")
            continue
        path = tempfile.mktemp(suffix=".json")
        cmd = [
            sys.executable,
            "-m",
            "kvserve.cli",
            "bench",
            "serve",
            "--compare",
            "served-vs-offline",
            "--model-dir",
            model_dir,
            "--serve-args",
            serve_args,
            "--num-prompts",
            str(n),
            "--input-len",
            str(in_len),
            "--output-len",
            str(out_len),
            "--range-ratio",
            "0",
            "--request-rate",
            "inf",
            "--max-concurrency",
            str(n),
            "--repeat",
            "1",
            "--result-json",
            path,
        ]
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        out[name] = dict(wall_s=time.perf_counter() - t, returncode=proc.returncode)
        if proc.returncode != 0:
            out[name]["error"] = proc.stdout[-2000:] + proc.stderr[-2000:]
            continue
        with open(path) as f:
            summary = json.load(f)["summary"]
        out[name].update(
            rows=summary["rows"],
            served_over_offline=summary["median_served_over_offline"],
            tpot_over_offline_step=summary["median_tpot_over_offline_step"],
        )
    return out


def _table(results: dict) -> str:
    lines = [f"device: {results['device']}"]
    g = results.get("graphs")
    if g:
        lines.append(
            f"graphs vs eager: identical sequences {g.get('identical_sequences')}; capture "
            f"{g.get('graphs', {}).get('capture_s', 0):.1f} s; ok={g.get('ok')}"
        )
    s = results.get("step")
    if s and "eager" in s:
        lines.append("decodes  model ms (eager / graphs)  core host ms  step ms (eager / graphs)")
        for e, c in zip(s["eager"], s.get("graphs", [])):
            if "model_ms" not in e or "model_ms" not in c:
                lines.append(f"{e['num_decodes']:>7}  skipped (time budget)")
                continue
            lines.append(
                f"{e['num_decodes']:>7}  {e['model_ms']:>8.2f} / {c['model_ms']:<8.2f}  {e['core_host_ms']:>8.2f}"
                f"      {e['step_ms']:>8.2f} / {c['step_ms']:.2f}"
            )
    v = results.get("served")
    if v:
        for name in ("eager", "graphs"):
            r = v.get(name)
            if r and "served_over_offline" in r:
                lines.append(
                    f"served vs offline ({name}): ratio {r['served_over_offline']:.2f}, TPOT / step "
                    f"{r['tpot_over_offline_step']:.2f}"
                )
            elif r:
                lines.append(f"served vs offline ({name}): {r.get('skipped') or r.get('error', '')[-300:]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parse(argv)
    import torch

    smoke = args.cpu_smoke or not torch.cuda.is_available()
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        from kvserve.runtime import cuda_graph_settings

        cuda_graph_settings.EMULATE_ON_CPU = True
    if args.piece:  # a child: one engine's worth of work, then exit (its memory goes with it)
        result = (
            graph_piece(args.mode, smoke, args.model_dir)
            if args.piece == "graphs"
            else step_piece(args.mode, smoke, args.model_dir, args.size)
        )
        with open(args.out, "w") as f:
            json.dump(result, f)
        return 0
    start = time.monotonic()
    deadline = start + args.budget_s
    results = dict(
        mode="cpu-smoke" if smoke else "cuda",
        python=platform.python_version(),
        torch=torch.__version__,
        device=torch.cuda.get_device_name(0) if not smoke else "cpu (Triton interpreter)",
    )
    ok = True
    for name, fn in (
        ("graphs", lambda: graph_check(smoke)),
        ("step", lambda: step_bench(smoke, deadline)),
        ("served", lambda: served_vs_offline(smoke, deadline)),
    ):
        if name in args.skip:
            continue
        if time.monotonic() > deadline:
            results[name] = dict(skipped="time budget")
            continue
        t = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as exc:  # one section failing must not lose the others' numbers
            import traceback

            results[name] = dict(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
            ok = False
        results[name]["section_s"] = time.perf_counter() - t
        with open(args.out, "w") as f:  # after every section: a timeout still leaves what was measured
            json.dump(results, f, indent=2)
    if isinstance(results.get("graphs"), dict) and results["graphs"].get("ok") is False:
        ok = False
    print(_table(results))
    print(f"wrote {args.out}; total {time.monotonic() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""kvserve against vLLM's CPU build inside ONE process, so both see the same machine state (this machine's speed
drifts by 2x over hours; `kvserve bench peer` alternates whole processes). Run it with the peer venv's python
(tools/make_peer_venv.sh), pinned to one core; it makes this checkout importable as `kvserve` there.

    taskset -c 1 ~/.cache/kvserve/peer-venv/bin/python tools/vs_vllm_inprocess.py attention decode|fresh|mixed
    taskset -c 1 ~/.cache/kvserve/peer-venv/bin/python tools/vs_vllm_inprocess.py engine [--prefix-caching]
        [--rounds 2] [--model HF_DIR] [--dtype float32]
    taskset -c 1 ~/.cache/kvserve/peer-venv/bin/python tools/vs_vllm_inprocess.py linear [--dtype float32]

attention: vLLM's `cpu_attention_with_kv_cache` (its AMX kernel, KV written by its own `cpu_attn_reshape_and_cache`
into its prepacked layout) against kvserve's paged op (AMX path on, and off) on the same q/K/V, 9/3 heads of 64
(SmolLM2), 30 layers each with its own cache, block 128, one thread; median of 20 interleaved steps. decode: 128
sequences of 201-241 keys; fresh: 8 prompts of 32-320 tokens; mixed: 90 decodes of 40-200 keys plus 7 prompts.
engine: both engines' LLM classes on the real model (SmolLM2 bf16) and the served workload offline (128 chat
prompts of 32-320 tokens, 16-48 outputs, max_num_seqs 128, 2048 batched tokens), generate() alternated
vLLM, kvserve, kvserve, vLLM: two unprofiled rounds (wall), then --rounds ABBA rounds under torch's profiler with
op time summed by kind (linears by rows, attention, element-wise, KV write). --model with a tiny random HF folder
(the same 30 layers and vocabulary, hidden 128) leaves mostly per-step overhead: wall minus op time.
linear: kvserve's linear (models/cpu_linear.py as the engine packs it: fp32 in kvserve's panel kernel, bf16 on
oneDNN's `mkldnn._linear_pointwise`) against vLLM's (`create_onednn_mm` / `onednn_mm`, its own oneDNN) on SmolLM2's
projection shapes at 64, 128 and 2,048 rows; best of 10 interleaved rounds of 8 weights each.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def make_kvserve_importable() -> None:
    """The peer venv has no kvserve: a temporary package whose subpackages link to this checkout's folders
    (pyproject's package-dir mapping)."""
    try:
        import kvserve.runtime  # noqa: F401

        return
    except ImportError:
        pass
    root = Path(tempfile.mkdtemp(prefix="kvserve-inprocess-"))
    pkg = root / "kvserve"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, folder in (("runtime", "runtime"), ("kernels", "kvkernels"), ("cli", "cli"), ("operator", "operator")):
        (pkg / name).symlink_to(REPO / folder)
    sys.path.insert(0, str(root))


def attention(mode: str) -> None:
    import torch
    import vllm._custom_ops as ops
    from vllm import envs

    from kvserve.kernels import cpu_ops

    if not cpu_ops.load():
        raise SystemExit(cpu_ops.describe())
    torch.set_num_threads(1)
    torch._C._cpu._init_amx()  # vLLM's worker asks for the tile data at start-up; its op alone does not
    heads, kv_heads, head_dim, block, layers = 9, 3, 64, 128, 30
    rng = random.Random(0)
    if mode == "decode":
        q_lens = [1] * 128
        lens = [rng.randint(201, 241) for _ in q_lens]
    elif mode == "fresh":
        q_lens = [rng.randint(32, 320) for _ in range(8)]
        lens = list(q_lens)
    elif mode == "mixed":
        q_lens = [1] * 90 + [rng.randint(32, 320) for _ in range(7)]
        lens = [rng.randint(40, 200) for _ in range(90)] + q_lens[90:]
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    seqs = len(q_lens)
    blocks = [-(-n // block) for n in lens]
    tables = torch.zeros(seqs, max(blocks), dtype=torch.int32)
    first = 1
    for s, n in enumerate(blocks):
        tables[s, :n] = torch.arange(first, first + n)
        first += n
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cu = torch.zeros(seqs + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    tokens, scale = int(cu[-1]), head_dim**-0.5
    q = torch.randn(tokens, heads, head_dim, dtype=torch.bfloat16)
    slots = torch.cat(
        [tables[s, torch.arange(n) // block].long() * block + torch.arange(n) % block for s, n in enumerate(lens)]
    )
    kv_caches, packed_caches, vllm_caches = [], [], []
    for _ in range(layers):  # every key of every sequence, written into both engines' caches
        k_all = torch.randn(sum(lens), kv_heads, head_dim, dtype=torch.bfloat16)
        v_all = torch.randn_like(k_all)
        kc = torch.zeros(first, block, kv_heads, head_dim, dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        kc.view(-1, kv_heads, head_dim)[slots] = k_all
        vc.view(-1, kv_heads, head_dim)[slots] = v_all
        kv_caches.append((kc, vc))
        kp, vp = torch.zeros_like(kc), torch.zeros_like(vc)  # the same keys in kvserve's AMX block layout
        torch.ops.kvserve_cpu.store_kv(k_all, v_all, kp, vp, slots, True)
        packed_caches.append((kp, vp))
        both = torch.zeros(first, kv_heads, block * 2, head_dim, dtype=torch.bfloat16)  # vLLM's [K; V] per block
        k_v, v_v = both.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k_all, v_all, k_v, v_v, slots, "amx")
        vllm_caches.append((k_v, v_v))
    meta = ops.cpu_attn_get_scheduler_metadata(
        seqs, heads, kv_heads, head_dim, seq_lens, torch.bfloat16, cu, True, -1, "amx", envs.VLLM_CPU_ATTN_SPLIT_KV
    )
    out_kv, out_vllm = torch.empty_like(q), torch.empty_like(q)

    def vllm_step() -> float:
        t0 = time.perf_counter()
        for k_v, v_v in vllm_caches:
            ops.cpu_attention_with_kv_cache(
                q, k_v, v_v, out_vllm, cu, seq_lens, scale, True, None, -1, tables, 0.0, meta, None
            )
        return time.perf_counter() - t0

    def kvserve_step(amx: bool, packed: bool = False) -> float:
        t0 = time.perf_counter()
        for kc, vc in packed_caches if packed else kv_caches:
            torch.ops.kvserve_cpu.paged_attention(
                out_kv, q, kc, vc, tables, seq_lens, cu, scale, 1 << 30, -1, amx, packed
            )
        return time.perf_counter() - t0

    vllm_step(), kvserve_step(True, True)
    diff = (out_kv.float() - out_vllm.float()).abs().max().item()
    runs: dict[str, list[float]] = {"vLLM": [], "kvserve packed": [], "kvserve AMX on": [], "kvserve AMX off": []}
    for _ in range(20):
        runs["vLLM"].append(vllm_step())
        runs["kvserve packed"].append(kvserve_step(True, True))
        runs["kvserve AMX on"].append(kvserve_step(True))
        runs["kvserve AMX off"].append(kvserve_step(False))
    print(
        f"attention {mode}: {tokens} query tokens, {seqs} sequences, {layers} layers; max |kvserve - vLLM| {diff:.4f}"
    )
    for name, samples in runs.items():
        print(f"  {name:16s} median {statistics.median(samples) * 1e3:7.1f} ms   min {min(samples) * 1e3:7.1f} ms")


KIND_ORDER = ["linear M=2048", "linear M<=128", "linear other M", "attention", "element-wise", "KV write", "other ops"]


def _kind(event) -> str:
    name, shapes = event.key, event.input_shapes
    if name in ("_C::onednn_mm", "_C::weight_packed_linear", "mkldnn::_linear_pointwise"):
        rows = shapes[0][0] if shapes and shapes[0] else -1
        return "linear M=2048" if rows == 2048 else "linear M<=128" if rows <= 128 else "linear other M"
    if "attention" in name:
        return "attention"
    if name == "## Call CompiledFxGraph None ##" or any(k in name for k in ("silu", "rms_norm", "rotary")):
        return "element-wise"  # vLLM: its torch.compile'd graph (norms, rotary, SiLU fused); kvserve: its ops
    if "reshape_and_cache" in name or "store_kv" in name:
        return "KV write"
    return "other ops"


def engine(prefix_caching: bool, rounds: int, model: str | None, dtype: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(sorted(os.sched_getaffinity(0))[0]))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    import torch
    from transformers import AutoTokenizer
    from vllm import LLM as VllmLLM
    from vllm import SamplingParams as VllmParams

    from kvserve.runtime import LLM, SamplingParams
    from kvserve.runtime.bench import real_model
    from kvserve.runtime.bench.real_prompts import chat_prompts_of_lengths

    model = model or real_model.hf_dir(dtype)
    rng = random.Random(0)
    prompt_lens = [rng.randint(32, 320) for _ in range(128)]
    output_lens = [rng.randint(16, 48) for _ in range(128)]
    prompts = chat_prompts_of_lengths(AutoTokenizer.from_pretrained(model), prompt_lens, 0)
    common = dict(max_model_len=400, max_num_seqs=128, max_num_batched_tokens=2048, block_size=128)
    vllm_llm = VllmLLM(model, dtype=dtype, seed=0, enable_prefix_caching=prefix_caching, **common)
    torch.set_num_threads(1)
    kv_llm = LLM(model, dtype=dtype, kv_cache_bytes=2 << 30, enable_prefix_caching=prefix_caching, **common)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    run = {
        "vllm": lambda: vllm_llm.generate(
            reqs, [VllmParams(temperature=0, max_tokens=o, ignore_eos=True) for o in output_lens], use_tqdm=False
        ),
        "kvserve": lambda: kv_llm.generate(
            reqs, [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in output_lens], use_tqdm=False
        ),
    }
    for f in run.values():
        f()  # warm-up (and, with prefix caching, the cache both engines then hit alike)
    print(
        f"engine: served workload offline, {sum(output_lens)} output tokens, prefix caching {prefix_caching}, "
        f"threads {torch.get_num_threads()}"
    )
    abba = ["vllm", "kvserve", "kvserve", "vllm"]
    for name in abba:
        t0 = time.perf_counter()
        run[name]()
        wall = time.perf_counter() - t0
        print(f"  wall      {name:8s} {wall:6.2f} s = {sum(output_lens) / wall:6.1f} tok/s", flush=True)
    for name in abba * rounds:
        with torch.profiler.profile(record_shapes=True, activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            run[name]()
            wall = time.perf_counter() - t0
        total: dict[str, float] = {}
        for event in prof.key_averages(group_by_input_shape=True):
            total[_kind(event)] = total.get(_kind(event), 0.0) + event.self_cpu_time_total / 1e6
        kinds = "  ".join(f"{k}: {total.get(k, 0.0):.2f}" for k in KIND_ORDER)
        print(f"  profiled  {name:8s} {wall:6.2f} s   op time (s): {kinds}", flush=True)


def _packed(weight):
    """A module holding `weight` as kvserve's engine packs it (models/cpu_linear.py: panels for fp32, oneDNN bf16)."""
    import torch

    from kvserve.runtime.models import cpu_linear

    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(weight, requires_grad=False)
    cpu_linear.pack_weight(module, module.weight, free_original=True)
    return module


def linear(dtype: str) -> None:
    import torch
    import vllm._custom_ops as ops

    from kvserve.runtime.models import cpu_linear

    torch.set_num_threads(1)
    torch._C._cpu._init_amx()
    shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
    for rows in (128, 64, 2048):
        for name, (out_features, in_features) in shapes.items():
            if rows == 2048 and name == "head":
                continue  # the LM head runs on the sampled rows only
            weights = [torch.randn(out_features, in_features, dtype=getattr(torch, dtype)) * 0.05 for _ in range(8)]
            x = torch.randn(rows, in_features, dtype=getattr(torch, dtype))
            ours = [_packed(w) for w in weights]
            theirs = [ops.create_onednn_mm(w.t(), 32) for w in weights]
            calls = {
                "kvserve": lambda x=x, ours=ours: [cpu_linear.linear(x, m, None) for m in ours],
                "vLLM": lambda x=x, theirs=theirs: [ops.onednn_mm(h, x, None) for h in theirs],
            }
            best = {k: float("inf") for k in calls}
            for i in range(11):
                for k in calls if i % 2 else reversed(list(calls)):
                    t0 = time.perf_counter()
                    calls[k]()
                    if i:  # the first round warms up
                        best[k] = min(best[k], (time.perf_counter() - t0) / len(weights))
            print(
                f"linear {name:8s} {rows:5d} rows: kvserve {best['kvserve'] * 1e6:8.1f} us  "
                f"vLLM {best['vLLM'] * 1e6:8.1f} us  ratio {best['kvserve'] / best['vLLM']:.2f}",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["attention", "engine", "linear"])
    ap.add_argument("mode", nargs="?", default="decode", help="attention: decode, fresh or mixed")
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--rounds", type=int, default=1, help="engine: profiled ABBA rounds")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="engine and linear")
    ap.add_argument(
        "--model", help="engine: an HF folder instead of SmolLM2 (e.g. a tiny random one: per-step overhead)"
    )
    args = ap.parse_args()
    make_kvserve_importable()
    if args.what == "attention":
        attention(args.mode)
    elif args.what == "linear":
        linear(args.dtype)
    else:
        engine(args.prefix_caching, args.rounds, args.model, args.dtype)


if __name__ == "__main__":
    main()

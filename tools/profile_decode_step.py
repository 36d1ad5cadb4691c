"""Per-decode-step op times of kvserve or vLLM's CPU build on one thread (issue 39's gap analysis,
docs/performance.md): 128 random 200-token prompts, prefix caching off, a budget that prefills them in one step;
each engine profiled (torch.profiler) with max_tokens 1 and 41, and the difference divided by 40 is 40 decode
steps at 200-240 tokens of context. Also prints the prefill run's top ops.

    taskset -c 1 .venv/bin/python tools/profile_decode_step.py kvserve [--model DIR]
    taskset -c 1 ~/.cache/kvserve/peer-venv/bin/python tools/profile_decode_step.py vllm [--model DIR]

(the peer venv: tools/make_peer_venv.sh; the default model: the bfloat16 HF folder runtime/bench/real_model.py
writes, ~/.cache/kvserve/default-model/<sha>/hf-bfloat16). Only the engine named is imported, so vLLM's venv
needs no kvserve.
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", choices=("kvserve", "vllm"))
    ap.add_argument("--model", default=None, help="HF folder (default: the dequantised SmolLM2 bf16 folder)")
    args = ap.parse_args()
    model = args.model or sorted(glob.glob(os.path.expanduser("~/.cache/kvserve/default-model/*/hf-bfloat16")))[-1]
    if args.engine == "vllm":
        for key, value in dict(
            VLLM_CPU_KVCACHE_SPACE="2",
            VLLM_CPU_OMP_THREADS_BIND=str(min(os.sched_getaffinity(0))),
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        ).items():
            os.environ.setdefault(key, value)
    import torch

    torch.set_num_threads(1)
    kw = dict(
        dtype="bfloat16",
        max_model_len=400,
        max_num_seqs=128,
        max_num_batched_tokens=32768,
        block_size=128,
        enable_prefix_caching=False,
    )
    if args.engine == "vllm":
        from vllm import LLM, SamplingParams

        llm = LLM(model, seed=0, **kw)
    else:
        from kvserve.runtime import LLM, SamplingParams

        llm = LLM(model, kv_cache_bytes=2 * 2**30, **kw)
    rng = random.Random(0)
    reqs = [{"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(200)]} for _ in range(128)]
    llm.generate(reqs[:8], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)

    def profile(max_tokens: int) -> tuple[float, dict[str, float]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            llm.generate(reqs, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
        return seconds, {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}

    t1, prefill = profile(1)
    t41, both = profile(41)
    print(f"{args.engine}: {(t41 - t1) / 40 * 1e3:.1f} ms per decode step of 128 sequences (wall, profiled)")
    per_step = sorted(((both.get(k, 0) - prefill.get(k, 0)) / 40, k) for k in set(prefill) | set(both))
    for ms, key in per_step[::-1][:8]:
        print(f"  {ms:7.2f} ms/step  {key}")
    print(f"prefill run ({t1:.2f} s wall, profiled), top ops:")
    for ms, key in sorted(((v, k) for k, v in prefill.items()), reverse=True)[:6]:
        print(f"  {ms:8.1f} ms  {key}")


if __name__ == "__main__":
    main()

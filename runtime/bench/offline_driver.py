"""One offline run of `kvserve bench peer`, the same code for both engines, in its own process.

Run as a script by path (`python offline_driver.py SPEC.json OUT.json`), by the peer venv's python for vLLM
and by the project's python for kvserve: it imports only the standard library at module level, then either
`vllm` or `kvserve.runtime` (never both, and nothing else of kvserve). The `__main__` guard is required:
vLLM starts its engine core with multiprocessing spawn, which re-imports this file.

SPEC.json: {"engine": "vllm"|"kvserve", "model": DIR, "dtype", "prompts": [[ids]], "output_lens": [n],
"max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len", "kv_cache_gib", "seed"}.
The KV budget reaches vLLM through VLLM_CPU_KVCACHE_SPACE, which the parent sets (vLLM's CPU build reads
it from the environment); kvserve gets the same bytes as kv_cache_bytes.
OUT.json: {"engine", "version", "init_s", "warmup_s", "seconds", "output_tokens", "token_ids": [[ids]]}.

Timing as vLLM's throughput benchmark: engine construction (load, compile, profile) and one short warm-up
generate are excluded; the timed part is one `generate` call over every request.
"""

from __future__ import annotations

import json
import sys
import time


def _make_engine(spec: dict):
    settings = dict(
        dtype=spec["dtype"],
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        block_size=spec["block_size"],
        max_model_len=spec["max_model_len"],
        seed=spec["seed"],
    )
    if spec["engine"] == "vllm":
        import vllm

        llm = vllm.LLM(model=spec["model"], **settings)
        return llm, vllm.SamplingParams, vllm.__version__
    from kvserve.runtime import LLM, SamplingParams

    llm = LLM(spec["model"], kv_cache_bytes=int(spec["kv_cache_gib"] * 2**30), **settings)
    try:
        from importlib.metadata import version

        ver = version("kvserve")
    except Exception:  # an uninstalled checkout
        ver = "unknown"
    return llm, SamplingParams, ver


def run(spec: dict) -> dict:
    t0 = time.perf_counter()
    llm, sampling_params, ver = _make_engine(spec)
    init_s = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": list(p)} for p in spec["prompts"]]
    t0 = time.perf_counter()
    # a short request no longer than request 0 (so it fits the max_model_len request 0 fits)
    warm = [{"prompt_token_ids": list(spec["prompts"][0][:16])}]
    llm.generate(
        warm,
        sampling_params(temperature=0.0, max_tokens=min(4, spec["output_lens"][0]), ignore_eos=True),
        use_tqdm=False,
    )
    warmup_s = time.perf_counter() - t0
    params = [sampling_params(temperature=0.0, max_tokens=n, ignore_eos=True) for n in spec["output_lens"]]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    return {
        "engine": spec["engine"],
        "version": ver,
        "init_s": init_s,
        "warmup_s": warmup_s,
        "seconds": seconds,
        "output_tokens": sum(len(t) for t in token_ids),
        "token_ids": token_ids,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: offline_driver.py SPEC.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    result = run(spec)
    with open(argv[1], "w") as f:
        json.dump(result, f)
    print(
        f"{spec['engine']}: {result['output_tokens']} output tokens in {result['seconds']:.2f} s "
        f"({result['output_tokens'] / result['seconds']:.1f} tok/s; init {result['init_s']:.1f} s)",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

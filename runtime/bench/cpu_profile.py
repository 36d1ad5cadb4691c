"""Profile one offline run (torch.profiler, CPU activities) and print the top ops by self CPU time.

The workload of `kvserve bench throughput` (random-weight 125M Llama, token-id prompts, ignore_eos, greedy):

    python runtime/bench/cpu_profile.py --dtype bfloat16 [--num-requests 96] [--attention-backend cpu|torch]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch


def main() -> None:
    from kvserve.runtime import LLM, SamplingParams
    from kvserve.runtime.bench.throughput import DEFAULT_SHAPE, Workload
    from kvserve.runtime.models.synthetic import make_random_model_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-requests", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(32, 320))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 160))
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--shapes", action="store_true", help="group the table by input shapes too")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvserve-prof-") as d:
        make_random_model_dir(d, "LlamaForCausalLM", seed=0, **DEFAULT_SHAPE)
        wl = Workload.random(
            args.num_requests, tuple(args.prompt_len), tuple(args.output_len), DEFAULT_SHAPE["vocab_size"], 0
        )
        kw = dict(attention_backend=args.attention_backend) if args.attention_backend else {}
        llm = LLM(
            d,
            dtype=args.dtype,
            max_model_len=max(map(len, wl.prompts)) + max(wl.output_lens),
            max_num_seqs=128,
            max_num_batched_tokens=2048,
            **kw,
        )
        print(f"attention backend: {llm.engine.config.attention_backend}; torch threads {torch.get_num_threads()}")
        llm.generate(
            [{"prompt_token_ids": wl.prompts[0][:16]}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False
        )
        reqs = [{"prompt_token_ids": p} for p in wl.prompts]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=args.shapes
        ) as prof:
            t0 = time.perf_counter()
            llm.generate(reqs, params, use_tqdm=False)
            wall = time.perf_counter() - t0
        print(
            f"{wl.num_output_tokens} output tokens in {wall:.1f} s under the profiler "
            f"({wl.num_output_tokens / wall:.0f} tok/s; the profiler adds overhead)"
        )
        print(
            prof.key_averages(group_by_input_shape=args.shapes).table(sort_by="self_cpu_time_total", row_limit=args.top)
        )
        llm.shutdown()


if __name__ == "__main__":
    main()

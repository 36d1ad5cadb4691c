"""`kvserve bench peaky`: offline generation on a random model with peaky attention against the same model with
flat attention, in one process, alternately (issue 39: no value-dependent slowdowns).

Peaky heads (attention sinks in real models; a large initializer_range in random ones) make most softmax
weights exp(score - max) underflow into subnormal floats, and subnormal arithmetic costs microcode assists on
x86: before the flush-to-zero fix a random 125M Llama at initializer_range 0.2 ran offline bf16 at 0.53x the
speed of the same shape at 0.02. This builds the random 125M Llama (runtime/bench/throughput.DEFAULT_SHAPE,
initializer_range 0.02: flat), and a copy whose q and k projections are multiplied by --qk-scale (scores x
qk_scale^2: peaky; how tests/kernels/test_cpu_ops_subnormals.py makes them, the share of underflowing
weights is printed), loads both into one process, and generates the same greedy workload on each in ABBA
order (both see the same background load). Printed: each run's output tok/s, and peaky/flat of the best runs;
the goal is >= 0.9 (within 10%).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

GOAL_RATIO = 0.9  # peaky tok/s / flat tok/s
UNDERFLOW_GAP = 87.34  # exp(-87.34) is FLT_MIN: a score this far under its row's max gives a subnormal weight


def make_peaky_copy(flat_dir: str, peaky_dir: str, qk_scale: float) -> float:
    """Copy flat_dir to peaky_dir with q_proj and k_proj scaled by qk_scale; returns layer 0's underflowing share."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(flat_dir, peaky_dir, dirs_exist_ok=True)
    tensors = load_file(os.path.join(flat_dir, "model.safetensors"))
    for name in tensors:
        if "q_proj" in name or "k_proj" in name:
            tensors[name] = tensors[name] * qk_scale
    save_file(tensors, os.path.join(peaky_dir, "model.safetensors"), metadata={"format": "pt"})
    return underflowing_fraction(tensors, _config(flat_dir))


def _config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def underflowing_fraction(tensors: dict, config: dict, tokens: int = 256) -> float:
    """Layer 0, head 0: the share of (query, key) pairs of random tokens whose softmax weight is subnormal
    (rotary left out: it turns q and k but keeps their norms)."""
    import torch

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    gen = torch.Generator().manual_seed(0)
    x = tensors["model.embed_tokens.weight"][torch.randint(0, config["vocab_size"], (tokens,), generator=gen)].float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    q = (x @ tensors["model.layers.0.self_attn.q_proj.weight"].float().T).view(tokens, heads, head_dim)[:, 0]
    k = (x @ tensors["model.layers.0.self_attn.k_proj.weight"].float().T).view(tokens, kv_heads, head_dim)[:, 0]
    scores = q @ k.T * head_dim**-0.5
    return ((scores.max(-1, keepdim=True).values - scores) > UNDERFLOW_GAP).float().mean().item()


def main(
    num_requests: int = 32,
    prompt_range=(128, 512),
    output_range=(32, 96),
    qk_scale: float = 25.0,
    dtype: str = "bfloat16",
    rounds: int = 1,
    seed: int = 0,
    json_out: str | None = None,
) -> dict:
    import torch

    from kvserve.runtime import LLM, SamplingParams
    from kvserve.runtime.bench.peer_tables import abba_order
    from kvserve.runtime.bench.throughput import DEFAULT_SHAPE, Workload
    from kvserve.runtime.models.synthetic import make_random_model_dir

    shape = dict(DEFAULT_SHAPE)
    wl = Workload.random(num_requests, tuple(prompt_range), tuple(output_range), shape["vocab_size"], seed)
    with tempfile.TemporaryDirectory(prefix="kvserve-peaky-") as tmp:
        dirs = {"flat": os.path.join(tmp, "flat"), "peaky": os.path.join(tmp, "peaky")}
        print(f"building the random 125M Llama (initializer_range 0.02) and its q/k x{qk_scale:g} copy ...", flush=True)
        make_random_model_dir(dirs["flat"], "LlamaForCausalLM", seed=seed, **shape)
        flat_share = underflowing_fraction(_load(dirs["flat"]), _config(dirs["flat"]))
        peaky_share = make_peaky_copy(dirs["flat"], dirs["peaky"], qk_scale)
        print(
            f"layer 0 head 0, subnormal softmax weights: flat {100 * flat_share:.1f}%, peaky {100 * peaky_share:.1f}%",
            flush=True,
        )
        max_model_len = max(len(p) for p in wl.prompts) + max(wl.output_lens)
        engines = {
            name: LLM(d, dtype=dtype, max_model_len=max_model_len, max_num_seqs=num_requests, seed=seed)
            for name, d in dirs.items()
        }
    prompts = [{"prompt_token_ids": p} for p in wl.prompts]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    for llm in engines.values():  # warm-up: allocator, kernels
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    print(
        f"workload: {num_requests} requests, {wl.num_prompt_tokens} prompt / {wl.num_output_tokens} output tokens "
        f"(random ids, greedy, ignore_eos), {dtype}, torch threads {torch.get_num_threads()}",
        flush=True,
    )
    runs = []
    for i, name in enumerate(abba_order("flat", "peaky", rounds), 1):
        load = os.getloadavg()[0]
        t = time.perf_counter()
        outs = engines[name].generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        runs.append(dict(model=name, seconds=seconds, tokens=tokens, tok_per_s=tokens / seconds, load_before=load))
        print(f"[{i}] {name:5s} {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s (load {load:.2f})")
    for llm in engines.values():
        llm.shutdown()
    best = {name: max(r["tok_per_s"] for r in runs if r["model"] == name) for name in engines}
    ratio = best["peaky"] / best["flat"]
    report = dict(
        dtype=dtype,
        qk_scale=qk_scale,
        subnormal_share=dict(flat=flat_share, peaky=peaky_share),
        workload=dict(
            num_requests=num_requests, prompt_tokens=wl.num_prompt_tokens, output_tokens=wl.num_output_tokens
        ),
        runs=runs,
        best_tok_per_s=best,
        ratio=ratio,
        goal=f"peaky >= {GOAL_RATIO:g}x flat",
        goal_met=ratio >= GOAL_RATIO,
    )
    print(
        f"\npeaky/flat offline {dtype}: {ratio:.3f} (best {best['peaky']:.1f} vs {best['flat']:.1f} tok/s); "
        f"goal >= {GOAL_RATIO:g}: {'met' if report['goal_met'] else 'NOT met'}"
    )
    if json_out:
        os.makedirs(os.path.dirname(os.path.abspath(json_out)), exist_ok=True)
        with open(json_out, "w") as f:
            json.dump(report, f, indent=2)
    return report


def _load(model_dir: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))

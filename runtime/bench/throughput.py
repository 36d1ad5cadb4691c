"""Offline throughput benchmark: kvserve vs transformers `generate` (static batches, left padding) on the
same model and the same requests, in one process: by default SmolLM2-135M-Instruct with chat-templated real
text (runtime/bench/real_model.py, real_prompts.py), or the random-weight 125M Llama (`--random-model`).
Prints useful output tokens/s of both, their ratio, the fraction of the FLOP roofline (peak measured here, in
this run), peak KV slots allocated vs used, and preemptions."""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from dataclasses import asdict, dataclass

from kvserve.runtime import engine_args

DEFAULT_SHAPE = dict(
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    intermediate_size=2048,
    vocab_size=32000,
    max_position_embeddings=2048,
    initializer_range=0.02,
    tie_word_embeddings=False,
)


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @classmethod
    def random(
        cls, num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab_size: int, seed: int
    ) -> "Workload":
        rng = random.Random(seed)
        prompts = [
            [rng.randrange(3, vocab_size) for _ in range(rng.randint(*prompt_range))] for _ in range(num_requests)
        ]
        return cls(prompts, [rng.randint(*output_range) for _ in range(num_requests)])

    @classmethod
    def chat(
        cls, model_dir: str, num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int
    ) -> "Workload":
        """Lengths drawn as `random` draws them; each prompt real text in the model's chat template, cut to its
        length (runtime/bench/real_prompts.py)."""
        from kvserve.runtime.bench.real_prompts import chat_prompts_of_lengths
        from kvserve.runtime.tokenizer import load_tokenizer

        rng = random.Random(seed)
        prompt_lens = [rng.randint(*prompt_range) for _ in range(num_requests)]
        output_lens = [rng.randint(*output_range) for _ in range(num_requests)]
        return cls(chat_prompts_of_lengths(load_tokenizer(model_dir), prompt_lens, seed), output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class Result:
    name: str
    seconds: float
    useful_output_tokens: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.useful_output_tokens / self.seconds


def run_kvserve(model_dir: str, wl: Workload, **engine_kwargs) -> tuple[Result, dict]:
    from kvserve.runtime import LLM, SamplingParams

    llm = LLM(model_dir, **engine_kwargs)
    engine = llm.engine
    # Warm-up (allocator, kernels), as vLLM's and nano-vllm's benchmarks do.
    llm.generate(
        [{"prompt_token_ids": wl.prompts[0][:16]}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    for i, (prompt, p) in enumerate(zip(wl.prompts, params)):
        engine.add_request(f"bench-{i}", {"prompt_token_ids": prompt}, p)
    kv, bs = engine.kv_cache_manager, engine.config.cache.block_size
    peak_allocated_slots, used_at_peak, steps, tokens_out = 0, 0, 0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens_out += len(out.outputs[0].token_ids)
        steps += 1
        # Slots held by running requests vs slots holding computed KV, at the allocation peak.
        allocated = sum(len(b) for b in kv.req_to_blocks.values()) * bs
        if allocated > peak_allocated_slots:
            peak_allocated_slots = allocated
            used_at_peak = sum(r.num_computed_tokens for r in engine.scheduler.running)
    seconds = time.perf_counter() - start
    stats = engine.get_stats()
    extra = dict(
        steps=steps,
        preemptions=stats.num_preemptions,
        peak_kv_slots_allocated=peak_allocated_slots,
        kv_slots_used_at_peak=used_at_peak,
        kv_waste_pct=100.0 * (1 - used_at_peak / peak_allocated_slots) if peak_allocated_slots else 0.0,
        num_kv_blocks=engine.config.cache.num_blocks - 1,
        block_size=bs,
    )
    if engine.config.world_size > 1:  # tensor / pipeline parallel: what each rank holds, measured there
        keys = ("rank", "pid", "param_bytes", "kv_tensor_bytes", "num_blocks", "kv_head_ids", "max_rss_bytes")
        extra["per_rank"] = [{k: getattr(i, k) for k in keys} for i in engine.executor.describe_ranks()]
    llm.shutdown()
    return Result("kvserve", seconds, tokens_out), extra


def run_hf(model_dir: str, wl: Workload, batch_size: int, dtype: str = "float32") -> Result:
    """transformers generate, static batches in arrival order, left padding; each batch runs to its
    longest requested output. Useful tokens are only the requested ones."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    start = time.perf_counter()
    with torch.no_grad():
        for b in range(0, len(wl.prompts), batch_size):
            prompts, lens = wl.prompts[b : b + batch_size], wl.output_lens[b : b + batch_size]
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            model.generate(
                ids, attention_mask=mask, max_new_tokens=max(lens), do_sample=False, pad_token_id=0, eos_token_id=-1
            )
    return Result("hf_generate", time.perf_counter() - start, wl.num_output_tokens)


def measured_peak_flops(
    hidden: int, intermediate: int, tokens: int = 256, repeats: int = 5, dtype: str = "float32"
) -> float:
    """FLOP/s of this machine on the model's own largest matmul shape, at a fat batch (best of N)."""
    import torch

    dt = getattr(torch, dtype)
    x, w = torch.randn(tokens, hidden, dtype=dt), torch.randn(2 * intermediate, hidden, dtype=dt)
    torch.nn.functional.linear(x, w)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(5):
            torch.nn.functional.linear(x, w)
        best = min(best, (time.perf_counter() - t) / 5)
    return 2 * tokens * hidden * 2 * intermediate / best


def shape_of_model_dir(model_dir: str) -> dict:
    """The roofline's shape keys from a model directory's config.json (nested text_config too), so that a
    `--model` run is measured against its own shape, not the default one."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config = {**config, **config.get("text_config", {})}
    shape = {k: config[k] for k in DEFAULT_SHAPE if k in config}
    if config.get("head_dim"):
        shape["head_dim"] = config["head_dim"]
    missing = {"hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"} - set(
        shape
    )
    if missing:
        raise ValueError(f"{model_dir}/config.json lacks {sorted(missing)}: cannot compute the roofline")
    shape.setdefault("num_key_value_heads", shape["num_attention_heads"])
    return shape


def model_flops(shape: dict, wl: Workload) -> float:
    """Matmul FLOPs the workload needs at minimum: every token through every linear layer, the LM head only
    for generated tokens, plus attention scores/values over each token's causal context."""
    h, layers, heads, kvh = (
        shape["hidden_size"],
        shape["num_hidden_layers"],
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
    )
    head_dim = shape.get("head_dim") or h // heads
    per_layer = h * (heads + 2 * kvh) * head_dim + heads * head_dim * h + 3 * h * shape["intermediate_size"]
    tokens = wl.num_prompt_tokens + wl.num_output_tokens
    flops = 2 * layers * per_layer * tokens + 2 * h * shape["vocab_size"] * wl.num_output_tokens
    ctx = sum(sum(range(1, len(p) + n + 1)) for p, n in zip(wl.prompts, wl.output_lens))
    return flops + 2 * 2 * layers * heads * head_dim * ctx


def main(
    num_requests: int = 32,
    prompt_range=(16, 256),
    output_range=(16, 128),
    seed: int = 0,
    hf_batch_size: int = 8,
    skip_hf: bool = False,
    model_dir: str | None = None,
    shape: dict | None = None,
    json_out: str | None = None,
    tensor_parallel_size: int = engine_args.default("tensor_parallel_size"),
    dtype: str = "float32",
    random_model: bool = False,
    random_prompts: bool = False,
    **engine_kwargs,
) -> dict:
    import torch

    from kvserve.runtime.models.synthetic import make_random_model_dir

    tmp = None
    if model_dir is None and not random_model:  # SmolLM2-135M-Instruct in `dtype`, for kvserve and transformers
        from kvserve.runtime.bench import real_model

        print(f"model: {real_model.describe(dtype)} ...", flush=True)
        model_dir = real_model.hf_dir(dtype)
    if model_dir is not None:
        # The model's own shape for the roofline; an explicit vocab size only narrows the workload's token ids.
        overrides = shape or {}
        shape = shape_of_model_dir(model_dir)
        workload_vocab = min(overrides.get("vocab_size", shape["vocab_size"]), shape["vocab_size"])
    else:
        shape = dict(DEFAULT_SHAPE, **(shape or {}))
        workload_vocab = shape["vocab_size"]
    if model_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvserve-bench-")
        model_dir = tmp.name
        print(
            f"building a random-weight Llama ({shape['hidden_size']} hidden, {shape['num_hidden_layers']} layers, "
            f"vocab {shape['vocab_size']}) in {model_dir} ...",
            flush=True,
        )
        make_random_model_dir(model_dir, "LlamaForCausalLM", seed=seed, **shape)
    if random_model or random_prompts:
        wl = Workload.random(num_requests, prompt_range, output_range, workload_vocab, seed)
    else:
        wl = Workload.chat(model_dir, num_requests, prompt_range, output_range, seed)
    prompt_kind = "random token ids" if random_model or random_prompts else "chat-templated text"
    print(
        f"workload: {num_requests} requests, {wl.num_prompt_tokens} prompt tokens ({prompt_kind}), "
        f"{wl.num_output_tokens} output tokens (ignore_eos), seed {seed}; torch threads {torch.get_num_threads()}",
        flush=True,
    )
    engine_kwargs.setdefault("max_model_len", max(len(p) for p in wl.prompts) + max(wl.output_lens))
    engine_kwargs.setdefault("max_num_seqs", num_requests)
    engine_kwargs.setdefault("max_num_batched_tokens", 512)
    engine_kwargs["dtype"] = dtype
    if tensor_parallel_size != 1:
        engine_kwargs["tensor_parallel_size"] = tensor_parallel_size
    ours, extra = run_kvserve(model_dir, wl, **engine_kwargs)
    print(
        f"kvserve: {ours.seconds:.1f} s, {ours.output_tokens_per_s:.1f} useful output tok/s, {extra['steps']} steps, "
        f"{extra['preemptions']} preemptions",
        flush=True,
    )
    peak = measured_peak_flops(shape["hidden_size"], shape["intermediate_size"], dtype=dtype)
    roofline_s = model_flops(shape, wl) / peak
    report = dict(
        workload=dict(
            num_requests=num_requests,
            prompt_tokens=wl.num_prompt_tokens,
            output_tokens=wl.num_output_tokens,
            prompts=prompt_kind,
            seed=seed,
            dtype=dtype,
        ),
        engine_kwargs=engine_kwargs,
        kvserve=asdict(ours) | {"tok_per_s": ours.output_tokens_per_s},
        **extra,
        measured_peak_gflops=peak / 1e9,
        roofline_seconds=roofline_s,
        roofline_fraction=roofline_s / ours.seconds,
    )
    if not skip_hf:
        print(f"running transformers generate (static batches of {hf_batch_size}, left padding) ...", flush=True)
        hf = run_hf(model_dir, wl, hf_batch_size, dtype)
        report["hf"] = asdict(hf) | {"tok_per_s": hf.output_tokens_per_s}
        report["speedup_vs_hf"] = ours.output_tokens_per_s / hf.output_tokens_per_s
        report["hf_roofline_fraction"] = roofline_s / hf.seconds
    print_report(report)
    if json_out:
        os.makedirs(os.path.dirname(os.path.abspath(json_out)), exist_ok=True)
        with open(json_out, "w") as f:
            json.dump(report, f, indent=2)
    if tmp is not None:
        tmp.cleanup()
    return report


def print_report(r: dict) -> None:
    print(f"\n=== offline throughput ({r['workload']['dtype']}) ===")
    print(f"kvserve        {r['kvserve']['seconds']:8.1f} s   {r['kvserve']['tok_per_s']:8.1f} useful output tok/s")
    if "hf" in r:
        print(f"HF generate    {r['hf']['seconds']:8.1f} s   {r['hf']['tok_per_s']:8.1f} useful output tok/s")
        print(
            f"speedup        {r['speedup_vs_hf']:8.2f} x   (HF at {100 * r['hf_roofline_fraction']:.0f}% of roofline)"
        )
    print(
        f"FLOP roofline  {r['roofline_seconds']:8.1f} s at {r['measured_peak_gflops']:.0f} GFLOP/s measured here "
        f"-> kvserve at {100 * r['roofline_fraction']:.0f}% of roofline"
    )
    print(
        f"KV at peak     {r['kv_slots_used_at_peak']} of {r['peak_kv_slots_allocated']} allocated slots used "
        f"-> waste {r['kv_waste_pct']:.2f}% (block_size {r['block_size']})"
    )
    print(f"preemptions    {r['preemptions']}")
    for i in r.get("per_rank", []):
        rss = f", peak RSS {i['max_rss_bytes'] / 2**20:.0f} MiB" if "max_rss_bytes" in i else ""
        print(
            f"rank {i['rank']} (pid {i['pid']}): weights {i['param_bytes'] / 2**20:.1f} MiB, KV cache "
            f"{i['kv_tensor_bytes'] / 2**20:.1f} MiB ({i['num_blocks']} blocks, KV heads {i['kv_head_ids']}){rss}"
        )

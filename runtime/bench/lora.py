"""Multi-LoRA benchmark (issue 24 item 8): throughput of one batch that uses 1, 4 or 16 different adapters
against the base model alone, on the same requests, in one process.

Two engines on the same model: one without --enable-lora (the plain baseline: no LoRA hooks at all) and one
with --enable-lora --max-loras = the most adapters asked for, which serves every row -- its base-only row
shows what merely enabling LoRA costs, the k-adapter rows what k distinct adapters in one batch cost. In a
k-adapter row the requests take the adapters round robin, so every step of the batch holds k of them (the
batched gather-by-adapter delta, never a merge). Adapters are random, PEFT-format, rank --rank on all seven
targets (written beside the run: `models/synthetic.make_random_adapter_dir`).

Each configuration runs `rounds` times, interleaved (a noisy neighbour slows all alike); reported: output
tokens/s (median) and its ratio to the plain base model. Timing excludes engine start and one warm-up per
configuration (which loads the adapters into their device slots). A check keeps the numbers honest: every
request under an adapter must give other greedy tokens than the plain base model, and every base request
on the --enable-lora engine the same ones; otherwise the run fails instead of printing a number.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass


@dataclass
class Row:
    label: str
    adapters: int  # distinct adapters in the batch (0: base model)
    lora_engine: bool  # served by the --enable-lora engine
    output_tokens_per_s: float
    seconds: float  # median wall time of one batch
    rows_changed: int  # requests whose greedy tokens differ from the plain base model's (0 for base rows)


def _prompts(num: int, prompt_len: int, vocab_size: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab_size) for _ in range(prompt_len)]} for _ in range(num)]


def _run(
    llm, prompts: list[dict], max_tokens: int, names: list[str | None] | None
) -> tuple[float, float, list[list[int]]]:
    from kvserve.runtime.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    kwargs = {"lora_request": names} if names is not None else {}
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, **kwargs)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if tokens != len(prompts) * max_tokens:  # ignore_eos: anything else is a broken run, not a number
        raise RuntimeError(f"expected {len(prompts) * max_tokens} output tokens, got {tokens}")
    return tokens / seconds, seconds, [list(o.outputs[0].token_ids) for o in outs]


def main(
    model_dir: str,
    adapter_counts: tuple[int, ...] = (1, 4, 16),
    num_requests: int = 32,
    prompt_len: int = 64,
    max_tokens: int = 32,
    rank: int = 16,
    rounds: int = 3,
    seed: int = 0,
    json_out: str | None = None,
    **engine_kwargs,
) -> list[Row]:
    from kvserve.runtime import LLM
    from kvserve.runtime.models.synthetic import make_random_adapter_dir

    most = max(adapter_counts)
    if num_requests < most:
        raise ValueError(f"num_requests ({num_requests}) must be >= the most adapters ({most}) to batch them all")
    kwargs = {
        "max_model_len": prompt_len + max_tokens + 16,
        "max_num_seqs": num_requests,  # the whole workload is one batch
        "max_num_batched_tokens": max(2048, num_requests * prompt_len),
        "seed": seed,
        **engine_kwargs,
    }
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-lora-") as tmp:
        names = [f"bench-{i}" for i in range(most)]
        modules = ",".join(
            f"{n}={make_random_adapter_dir(model_dir, f'{tmp}/{n}', rank=rank, seed=seed + i)}"
            for i, n in enumerate(names)
        )
        plain = LLM(model_dir, **kwargs)
        lora = LLM(model_dir, enable_lora=True, lora_modules=modules, max_loras=most, max_lora_rank=rank, **kwargs)
        try:
            prompts = _prompts(num_requests, prompt_len, plain.engine.config.model.vocab_size, seed)
            # (label, distinct adapters, engine, the adapters its requests take round robin; None: no lora_request)
            configs: list[tuple[str, int, object, list | None]] = [
                ("base, no --enable-lora", 0, plain, None),
                ("base, --enable-lora", 0, lora, [None]),
            ]
            for k in adapter_counts:
                configs.append((f"{k} adapter{'s' if k > 1 else ''}", k, lora, names[:k]))
            for _, _, llm, picks in configs:  # warm-up: shapes, allocator, every adapter into its slot
                _run(llm, prompts[: len(picks or [None])], 4, picks)
            samples: dict[str, list[tuple[float, float, list]]] = {c[0]: [] for c in configs}
            for _ in range(rounds):
                for label, _, llm, picks in configs:
                    row_names = [picks[i % len(picks)] for i in range(num_requests)] if picks else None
                    samples[label].append(_run(llm, prompts, max_tokens, row_names))
        finally:
            plain.shutdown()
            lora.shutdown()
    base_tokens = samples[configs[0][0]][0][2]
    rows = [
        Row(
            label,
            k,
            llm is not plain,
            statistics.median(s[0] for s in samples[label]),
            statistics.median(s[1] for s in samples[label]),
            sum(a != b for a, b in zip(samples[label][0][2], base_tokens)),
        )
        for label, k, llm, _ in configs
    ]
    # The numbers mean something only if the adapters were applied and the base rows were not touched.
    for r in rows:
        if (r.adapters > 0) != (r.rows_changed > 0):
            raise RuntimeError(f"{r.label}: {r.rows_changed} of {num_requests} requests differ from the base model's")
    base = rows[0].output_tokens_per_s
    print(
        f"{num_requests} requests x ({prompt_len} prompt + {max_tokens} output tokens) in one batch, adapters of "
        f"rank {rank} on 7 targets, {rounds} interleaved rounds, medians"
    )
    print(f"{'configuration':<24} {'output tok/s':>12} {'batch s':>8} {'vs base':>8} {'tokens != base':>14}")
    for r in rows:
        print(
            f"{r.label:<24} {r.output_tokens_per_s:>12.1f} {r.seconds:>8.2f} {r.output_tokens_per_s / base:>7.2f}x "
            f"{r.rows_changed:>8}/{num_requests}"
        )
    if json_out:
        settings = {"num_requests": num_requests, "prompt_len": prompt_len, "max_tokens": max_tokens, "rank": rank}
        with open(json_out, "w") as f:
            json.dump({"settings": settings, "results": [asdict(r) for r in rows]}, f, indent=2)
    return rows

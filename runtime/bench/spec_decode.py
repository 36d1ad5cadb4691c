"""Speculative decoding benchmark: the same requests with and without --speculative-config, in one process,
interleaved round by round (so a noisy neighbour slows both alike), at several numbers of concurrent streams.

Workloads (token ids, so any model works):
- repetitive: each prompt is a random chunk repeated three times; a model that copies (induction) continues
  the pattern, which n-gram/suffix proposals predict -- the prompt-copying case (code edits, RAG quotes);
- random: random ids, sampled at temperature 1.0 (seeded): high-entropy output that drafts rarely
  predict, so this measures what rejected drafts cost.

Per configuration it reports output tokens/s, mean time per output token after the first (TPOT: a request's
decode time / (tokens - 1); with drafts, tokens arrive in bursts and this is their average spacing), the
acceptance counters, and the ratio speculative / plain. Medians over rounds."""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import asdict, dataclass

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


@dataclass
class Measurement:
    workload: str
    streams: int
    spec: bool
    output_tokens_per_s: float
    tpot_ms: float
    drafts: int
    draft_tokens: int
    accepted_tokens: int


def make_prompts(kind: str, num: int, vocab_size: int, seed: int, chunk_len: int = 24) -> list[dict]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        if kind == "repetitive":
            chunk = [rng.randrange(3, vocab_size) for _ in range(chunk_len)]
            ids = chunk * 3
        elif kind == "random":
            ids = [rng.randrange(3, vocab_size) for _ in range(3 * chunk_len)]
        else:
            raise ValueError(f"workload must be repetitive or random, got {kind!r}")
        prompts.append({"prompt_token_ids": ids})
    return prompts


def _run_once(
    llm, prompts: list[dict], max_tokens: int, temperature: float
) -> tuple[float, float, tuple[int, int, int]]:
    from kvserve.runtime.sampling_params import SamplingParams

    before = llm.engine.get_stats()
    params = SamplingParams(temperature=temperature, seed=1, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.engine.get_stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    tpots = [
        (o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
        for o in outs
        if len(o.outputs[0].token_ids) > 1
    ]
    counters = (
        after.spec_num_drafts - before.spec_num_drafts,
        after.spec_num_draft_tokens - before.spec_num_draft_tokens,
        after.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
    )
    return tokens / seconds, statistics.mean(tpots) * 1000, counters


def main(
    model_dir: str,
    spec: dict | None = None,
    streams: tuple[int, ...] = (1, 8, 64),
    workloads: tuple[str, ...] = ("repetitive", "random"),
    max_tokens: int = 128,
    rounds: int = 3,
    seed: int = 0,
    json_out: str | None = None,
    **engine_kwargs,
) -> list[Measurement]:
    from kvserve.runtime import LLM
    from kvserve.runtime.speculative_config import parse_speculative_config

    spec = spec or DEFAULT_SPEC
    switch_off = parse_speculative_config(spec).disable_by_batch_size
    kwargs = {"max_model_len": 512, "max_num_seqs": max(streams), "seed": seed, **engine_kwargs}
    plain_llm = LLM(model_dir, **kwargs)
    spec_llm = LLM(model_dir, speculative_config=spec, **kwargs)
    vocab = plain_llm.engine.config.model.vocab_size
    results: list[Measurement] = []
    print(f"speculative config: {json.dumps(spec)}; {rounds} interleaved rounds, medians")
    print(
        f"{'workload':<11} {'streams':>7} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} "
        f"{'plain TPOT':>10} {'spec TPOT':>9} {'accept':>7} {'tok/draft':>9}"
    )
    for workload in workloads:
        for n in streams:
            prompts = make_prompts(workload, n, vocab, seed)
            temperature = 0.0 if workload == "repetitive" else 1.0
            for llm in (plain_llm, spec_llm):  # warm-up: shapes, allocator, caches
                _run_once(llm, prompts[:1], 8, temperature)
            runs: dict[bool, list] = {False: [], True: []}
            for _ in range(rounds):
                for is_spec, llm in ((False, plain_llm), (True, spec_llm)):
                    runs[is_spec].append(_run_once(llm, prompts, max_tokens, temperature))
            row = {}
            for is_spec, samples in runs.items():
                drafts, draft_tokens, accepted = (sum(s[2][i] for s in samples) for i in range(3))
                m = Measurement(
                    workload,
                    n,
                    is_spec,
                    statistics.median(s[0] for s in samples),
                    statistics.median(s[1] for s in samples),
                    drafts,
                    draft_tokens,
                    accepted,
                )
                results.append(m)
                row[is_spec] = m
            p, s = row[False], row[True]
            rate = s.accepted_tokens / s.draft_tokens if s.draft_tokens else 0.0
            per_draft = 1 + s.accepted_tokens / s.drafts if s.drafts else 0.0
            print(
                f"{workload:<11} {n:>7} {p.output_tokens_per_s:>11.1f} {s.output_tokens_per_s:>10.1f} "
                f"{s.output_tokens_per_s / p.output_tokens_per_s:>5.2f}x {p.tpot_ms:>8.2f}ms {s.tpot_ms:>7.2f}ms "
                f"{rate:>6.0%} {per_draft:>9.2f}"
                + (f"  (drafting off: {n} > disable_by_batch_size {switch_off})" if n > switch_off else "")
            )
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"spec": spec, "results": [asdict(r) for r in results]}, f, indent=2)
    return results

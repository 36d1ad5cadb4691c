"""Per-step host overhead benchmark: at N running decodes, how much of one engine step is model time and
how much is the serving stack's own host work (scheduling, input preparation, output bookkeeping).

It drives the real `LLMEngine` and times its phases by wrapping, on the instances, `scheduler.schedule`,
`runner.execute`, `scheduler.update_from_output`, the model's `__call__` / `compute_logits` and, where the runner
has one, its greedy head's `tokens` (CPU: the LM head of all-greedy steps, runtime/models/greedy_head.py), so the
same benchmark runs unchanged on older checkouts, for before/after tables. Per step:

- model     = the forward plus the LM head (device work; synchronised on CUDA so it is really measured);
              with --cuda-graphs, the graph replay and its input copies;
- core host = schedule + (execute - model) + update_from_output: the engine core's host cost per step;
- front-end = the rest of `LLMEngine.step()` (detokenisation, stop strings, RequestOutputs), which issue 10
  moves out of the core's process, so it is reported apart.

Only steps with exactly N requests decoding one token each are measured (prefill steps are skipped).
"""

from __future__ import annotations

import json
import os
import pickle
import statistics
import time
from dataclasses import asdict, dataclass, field

from kvserve.runtime import engine_args

PHASES = ("schedule", "execute", "model", "update", "step")


@dataclass
class StepTimes:
    """Seconds per phase, one entry per measured step."""

    schedule: list[float] = field(default_factory=list)
    execute: list[float] = field(default_factory=list)
    model: list[float] = field(default_factory=list)
    update: list[float] = field(default_factory=list)
    step: list[float] = field(default_factory=list)
    sched_out_bytes: list[int] = field(default_factory=list)  # pickled SchedulerOutput (what TP sends each rank)

    def median_ms(self, phase: str) -> float:
        return 1e3 * statistics.median(getattr(self, phase))


@dataclass
class BatchResult:
    num_decodes: int
    num_steps: int
    model_ms: float
    schedule_ms: float
    prepare_and_sample_ms: float  # execute minus model
    update_ms: float
    core_host_ms: float
    core_host_best_ms: float  # the fastest measured step: least disturbed by other processes on the machine
    front_end_ms: float
    step_ms: float
    sched_out_bytes: int


class _TimedModel:
    """Stands in for runner.model: times the forward and the LM head, forwards everything else."""

    def __init__(self, model, sink: list[float], sync):
        self._model, self._sink, self._sync = model, sink, sync

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        out = self._model(*args, **kwargs)
        self._sync()
        self._sink[0] += time.perf_counter() - t
        return out

    def compute_logits(self, *args, **kwargs):
        t = time.perf_counter()
        out = self._model.compute_logits(*args, **kwargs)
        self._sync()
        self._sink[0] += time.perf_counter() - t
        return out

    def __getattr__(self, name):
        return getattr(self._model, name)


def _instrument(engine):
    """Wrap the engine's phases; returns the per-step accumulator (seconds) the wrappers add into."""
    import torch

    acc = dict(schedule=0.0, execute=0.0, update=0.0, bytes=0, decode_only=False)
    model_s = [0.0]
    runner = engine.executor.runner  # one rank, in this process (UniprocExecutor)
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    runner.model = _TimedModel(runner.model, model_s, sync)
    head = getattr(runner, "greedy_head", None)
    if head is not None:  # all-greedy steps take their tokens from the LM head here, not from compute_logits
        head_tokens = head.tokens

        def timed_tokens(*args):
            t = time.perf_counter()
            out = head_tokens(*args)
            model_s[0] += time.perf_counter() - t
            return out

        head.tokens = timed_tokens
    graphs = getattr(runner, "decode_graphs", None)
    if graphs is not None:  # --cuda-graphs: a decode step's forward is a graph replay (plus its input copies)
        replay = graphs.run

        def timed_replay(*args):
            t = time.perf_counter()
            out = replay(*args)
            sync()
            model_s[0] += time.perf_counter() - t
            return out

        graphs.run = timed_replay
    schedule, execute, update = (engine.scheduler.schedule, runner.execute, engine.scheduler.update_from_output)

    def timed_schedule():
        t = time.perf_counter()
        out = schedule()
        acc["schedule"] += time.perf_counter() - t
        acc["bytes"] = len(pickle.dumps(out, pickle.HIGHEST_PROTOCOL))  # outside the timed region
        acc["decode_only"] = (
            bool(out.scheduled) and not out.new_requests and all(len(s.token_ids) == 1 for s in out.scheduled)
        )
        return out

    def timed_execute(sched):
        t = time.perf_counter()
        out = execute(sched)
        acc["execute"] += time.perf_counter() - t
        return out

    def timed_update(sched, runner_out):
        t = time.perf_counter()
        out = update(sched, runner_out)
        acc["update"] += time.perf_counter() - t
        return out

    engine.scheduler.schedule = timed_schedule
    runner.execute = timed_execute
    engine.scheduler.update_from_output = timed_update
    return acc, model_s


def run_batch(
    model_dir: str,
    num_decodes: int,
    prompt_len: int,
    num_steps: int,
    warmup_steps: int,
    block_size: int,
    seed: int,
    random_prompts: bool = False,
    **engine_kwargs,
) -> BatchResult:
    import random

    from kvserve.runtime.engine.llm_engine import LLMEngine
    from kvserve.runtime.sampling_params import SamplingParams

    budget = engine_kwargs.pop("max_num_batched_tokens", max(2048, num_decodes))
    # The first requests decode while later ones still prefill: their outputs must outlast that too.
    num_prefill_steps = -(-num_decodes * prompt_len // budget) + 1
    max_model_len = prompt_len + num_prefill_steps + warmup_steps + num_steps + 8
    num_blocks = num_decodes * -(-max_model_len // block_size) + 1  # no preemption: every request fits
    kwargs = dict(
        max_num_seqs=num_decodes,
        max_model_len=max_model_len,
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_num_batched_tokens=budget,
    )
    kwargs.update(engine_kwargs)
    if kwargs.get("cuda_graphs") and not kwargs.get("cuda_graph_sizes"):
        kwargs["cuda_graph_sizes"] = str(num_decodes)  # capture just the measured size: start-up stays short
    engine = LLMEngine.from_kwargs(model_dir, **kwargs)
    vocab = engine.config.model.vocab_size
    rng = random.Random(seed)
    # Distinct prompts (no prefix sharing): chat-templated real text (runtime/bench/real_prompts.py), or random
    # token ids; outputs long enough to outlast the measured steps.
    params = SamplingParams(temperature=0, max_tokens=max_model_len - prompt_len, ignore_eos=True)
    if random_prompts:
        prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(num_decodes)]
    else:
        from kvserve.runtime.bench.real_prompts import chat_prompt_ids

        prompts = chat_prompt_ids(engine.tokenizer, num_decodes, prompt_len, seed)
    for i, ids in enumerate(prompts):
        engine.add_request(f"step-{i}", {"prompt_token_ids": ids}, params)
    acc, model_s = _instrument(engine)
    times = StepTimes()
    num_decode_steps = 0
    while num_decode_steps < warmup_steps + num_steps:
        acc.update(schedule=0.0, execute=0.0, update=0.0)
        model_s[0] = 0.0
        t = time.perf_counter()
        engine.step()
        step_s = time.perf_counter() - t
        if not acc["decode_only"] or engine.scheduler.num_running != num_decodes:
            if num_decode_steps:
                raise RuntimeError("a measured step was not a pure decode of every request (preempted? finished?)")
            continue  # still prefilling
        num_decode_steps += 1
        if num_decode_steps <= warmup_steps:
            continue
        times.schedule.append(acc["schedule"])
        times.execute.append(acc["execute"])
        times.model.append(model_s[0])
        times.update.append(acc["update"])
        times.step.append(step_s)
        times.sched_out_bytes.append(acc["bytes"])
    engine.shutdown()
    # Per-step differences first, then the median: phases of one step belong together.
    core = [s + (e - m) + u for s, e, m, u in zip(times.schedule, times.execute, times.model, times.update)]
    front = [st - s - e - u for st, s, e, u in zip(times.step, times.schedule, times.execute, times.update)]
    prep = [e - m for e, m in zip(times.execute, times.model)]
    return BatchResult(
        num_decodes=num_decodes,
        num_steps=num_steps,
        model_ms=times.median_ms("model"),
        schedule_ms=times.median_ms("schedule"),
        prepare_and_sample_ms=1e3 * statistics.median(prep),
        update_ms=times.median_ms("update"),
        core_host_ms=1e3 * statistics.median(core),
        core_host_best_ms=1e3 * min(core),
        front_end_ms=1e3 * statistics.median(front),
        step_ms=times.median_ms("step"),
        sched_out_bytes=int(statistics.median(times.sched_out_bytes)),
    )


def main(
    model_dir: str | None = None,
    batch_sizes=(64, 256, 512),
    prompt_len: int = 128,
    num_steps: int = 20,
    warmup_steps: int = 3,
    block_size: int = engine_args.default("block_size"),
    seed: int = 0,
    json_out: str | None = None,
    random_prompts: bool = False,
    **engine_kwargs,
) -> list[BatchResult]:
    import torch

    if model_dir is None:  # the default model (SmolLM2-135M-Instruct), or offline the random-weights demo
        from kvserve.runtime.default_model import resolve_default_model

        model_dir = resolve_default_model()[0]
    print(
        f"model {model_dir}; prompts {prompt_len} tokens "
        f"({'random ids' if random_prompts else 'chat-templated text'}); "
        f"{num_steps} measured decode steps after {warmup_steps} warm-up; torch threads {torch.get_num_threads()}",
        flush=True,
    )
    results = []
    for n in batch_sizes:
        r = run_batch(
            model_dir, n, prompt_len, num_steps, warmup_steps, block_size, seed, random_prompts, **engine_kwargs
        )
        results.append(r)
        print(f"  {n} decodes: core host {r.core_host_ms:.2f} ms, model {r.model_ms:.2f} ms", flush=True)
    print_table(results)
    if json_out:
        os.makedirs(os.path.dirname(os.path.abspath(json_out)), exist_ok=True)
        with open(json_out, "w") as f:
            json.dump(
                dict(model_dir=model_dir, prompt_len=prompt_len, results=[asdict(r) for r in results]), f, indent=2
            )
    return results


def print_table(results: list[BatchResult]) -> None:
    print("\n=== host time vs model time per decode step (medians, ms) ===")
    print(
        f"{'decodes':>8} {'core host':>10} {'(best)':>7} {'schedule':>9} {'prep+samp':>10} {'update':>7} {'model':>8} "
        f"{'front-end':>10} {'step':>8} {'sched out':>10}"
    )
    for r in results:
        print(
            f"{r.num_decodes:>8} {r.core_host_ms:>10.2f} {r.core_host_best_ms:>7.2f} {r.schedule_ms:>9.2f} "
            f"{r.prepare_and_sample_ms:>10.2f} "
            f"{r.update_ms:>7.2f} {r.model_ms:>8.2f} {r.front_end_ms:>10.2f} {r.step_ms:>8.2f} "
            f"{r.sched_out_bytes / 1024:>8.1f}KiB"
        )
    print(
        "core host = schedule + prep+samp (execute minus model) + update; front-end = output processing and "
        "detokenisation (leaves the core in issue 10); sched out = pickled SchedulerOutput per step"
    )

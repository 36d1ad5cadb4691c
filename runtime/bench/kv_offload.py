"""Host KV tier benchmark (issue 41 scope 5): a multi-turn chat workload whose working set is about `ratio`
times the device KV pool, with --kv-offloading-size on and off, on the same engine settings.

The workload: `conversations` chats that share one long system prompt; every turn re-asks each chat with
its whole history (system prompt, earlier questions and the engine's own answers) plus a new question, one
batch per turn (or paced: --conversation-rate, --think-time). The device pool holds 1/ratio of the last
turn's distinct KV (the shared system prompt counted once), so a chat's history is evicted before it is asked
again: with the tier off it is recomputed (past the shared system prompt, which stays hot), with the tier on
it comes back from host RAM. kv_offload_replay.py replays the same workload through the real scheduler
without a model: step counts, deterministic.

Reported per setting: TTFT p50 / p90 (time.monotonic first token - arrival, over every request of turns 2..),
output tokens/s over the whole run, tokens computed by the forward, tokens loaded from the tier, the device
prefix-cache hit rate. A check keeps it honest: greedy tokens must be identical on and off, or no number is
printed. Run it on a quiet machine (timings on a shared one are noise):

    python -m kvserve.runtime.bench.kv_offload MODEL --conversations 32 --turns 4 --ratio 4

MODEL is a model folder or a .gguf file (prepared as `kvserve serve` prepares it: runtime/gguf_model_dir.py).
Where TTFT goes: every request's TTFT splits into its queue wait (arrival -> first scheduled: waiting for
device blocks while earlier requests decode) and its prefill (first scheduled -> first token: its own forward,
the tier's loads included); `ttft_p90_queue_s` is the queue share of the request at the p90.

The cost of the tier when nothing is reused (saves only; must be within noise): `--turns 1 --system-len 0`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass

from kvserve.runtime import engine_args


@dataclass
class Row:
    tier: str  # "off" or the --kv-offloading-size in GiB
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p90_queue_s: float  # of the request nearest the p90: its wait for admission (the rest is its prefill)
    output_tokens_per_s: float
    computed_tokens: int
    loaded_tokens: int
    device_prefix_hit_rate: float
    num_kv_blocks: int
    working_set_blocks: int = 0  # distinct KV blocks of the last turn (PoolShape)


@dataclass(frozen=True)
class PoolShape:
    working_set_blocks: int  # distinct KV blocks of the last turn: the shared system prompt's full blocks once
    num_kv_blocks: int  # the device pool: working_set_blocks / ratio
    max_model_len: int


def pool_shape(
    conversations: int, turns: int, system_len: int, question_len: int, answer_len: int, block_size: int, ratio: float
) -> PoolShape:
    """The device pool for a working set `ratio` times its size. The working set counts the system prompt's
    full blocks once (every conversation shares them: the prefix cache holds one copy), so a ratio of 4
    means the conversations' distinct KV is 4x the pool, not 4x counting the shared prompt per chat."""
    last_turn_blocks = -(-(system_len + turns * (question_len + answer_len)) // block_size)
    shared = system_len // block_size
    working_set = shared + conversations * (last_turn_blocks - shared)
    # At least two sequences of the longest turn, so the pool is never too small to run at all.
    num_kv_blocks = max(int(working_set / ratio), 2 * last_turn_blocks + 1)
    return PoolShape(working_set, num_kv_blocks, last_turn_blocks * block_size)


def _workload(num: int, turns: int, system_len: int, question_len: int, vocab: int, seed: int):
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(system_len)]
    questions = [[[rng.randrange(3, vocab) for _ in range(question_len)] for _ in range(turns)] for _ in range(num)]
    return system, questions


def _paced(llm, histories: list[list[int]], questions, params, rate: float, think_s: float) -> dict:
    """Conversations as clients: conversation i asks its first turn at i / rate seconds, and each next turn
    think_s after its answer. Returns (conversation, turn) -> RequestOutput; histories grow as answers come."""
    engine = llm.engine
    num_turns = len(questions[0])
    t0 = time.monotonic()
    due = {i: t0 + i / rate for i in range(len(questions))}  # conversation -> when its next turn arrives
    next_turn = [0] * len(questions)
    asked: dict[str, tuple[int, int, list[int]]] = {}
    results = {}
    while due or engine.has_unfinished_requests():
        now = time.monotonic()
        for i, at in sorted(due.items(), key=lambda kv: kv[1]):
            if at <= now:
                prompt = histories[i] + questions[i][next_turn[i]]
                rid = f"c{i}-t{next_turn[i]}"
                asked[rid] = (i, next_turn[i], prompt)
                engine.add_request(rid, engine.prepare({"prompt_token_ids": prompt}, params), arrival_time=at)
                del due[i]
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(due.values()) - time.monotonic()))
            continue
        for out in engine.step():
            if out.finished:
                i, turn, prompt = asked[out.request_id]
                results[(i, turn)] = out
                histories[i] = prompt + list(out.outputs[0].token_ids)
                next_turn[i] += 1
                if next_turn[i] < num_turns:
                    due[i] = time.monotonic() + think_s
    return results


def _run(
    model_dir: str,
    system,
    questions,
    answer_len: int,
    offload_gib: float | None,
    rate: float | None = None,
    think_s: float = 0.0,
    **engine_kwargs,
):
    from kvserve.runtime import LLM, SamplingParams

    llm = LLM(model_dir, kv_offloading_size=offload_gib, **engine_kwargs)
    computed = []
    llm.engine.core.step_observers.append(lambda sched, _s: computed.append(sum(len(s.token_ids) for s in sched)))
    params = SamplingParams(temperature=0.0, max_tokens=answer_len, ignore_eos=True)
    histories = [list(system) for _ in questions]
    ttfts, queued, tokens, out_tokens = [], [], [], 0
    start = time.perf_counter()
    paced = _paced(llm, histories, questions, params, rate, think_s) if rate else None
    for turn in range(len(questions[0])):
        if paced is not None:
            outs = [paced[(i, turn)] for i in range(len(questions))]
        else:
            prompts = [h + q[turn] for h, q in zip(histories, questions)]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for i, o in enumerate(outs):
            answer = list(o.outputs[0].token_ids)
            if paced is None:
                histories[i] = prompts[i] + answer
            tokens.append(answer)
            out_tokens += len(answer)
            if turn or len(questions[0]) == 1:  # turn 1 only: the no-reuse cost run
                ttfts.append(o.metrics.first_token_time - o.metrics.arrival_time)
                queued.append(o.metrics.first_scheduled_time - o.metrics.arrival_time)
    seconds = time.perf_counter() - start
    stats = llm.engine.get_stats()
    loaded = llm.engine.scheduler.num_offload_loaded_tokens
    num_blocks = llm.engine.config.cache.num_blocks
    llm.shutdown()
    deciles = statistics.quantiles(ttfts, n=10)
    at_p90 = min(range(len(ttfts)), key=lambda i: abs(ttfts[i] - deciles[8]))
    row = Row(
        "off" if not offload_gib else f"{offload_gib:g} GiB",
        statistics.median(ttfts),
        deciles[8],
        queued[at_p90],
        out_tokens / seconds,
        sum(computed),
        loaded,
        stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1),
        num_blocks,
    )
    return row, tokens, max(len(h) for h in histories)


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a model folder or a .gguf file")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=256, help="tokens of the shared system prompt")
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--answer-len", type=int, default=32)
    ap.add_argument("--ratio", type=float, default=4.0, help="working set / device KV pool")
    ap.add_argument("--block-size", type=int, default=engine_args.default("block_size"))
    ap.add_argument("--offload-gib", type=float, default=1.0, help="--kv-offloading-size of the 'on' run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--conversation-rate",
        type=float,
        default=None,
        help="paced arrivals instead of one burst per turn: conversations start at this rate (per second) and "
        "ask each next turn --think-time after the answer",
    )
    ap.add_argument("--think-time", type=float, default=0.0, help="seconds between an answer and the next turn")
    ap.add_argument(
        "--order", choices=("off-on", "on-off"), default="off-on", help="which run first (ABBA on a shared machine)"
    )
    ap.add_argument("--json-out")
    a = ap.parse_args(argv)
    from kvserve.runtime import gguf_model_dir
    from kvserve.runtime.config import read_config_json

    model_dir = gguf_model_dir.resolve(a.model)  # a .gguf file: its prepared folder (config.json, tokenizer)
    vocab = int(read_config_json(model_dir)["vocab_size"])
    system, questions = _workload(a.conversations, a.turns, a.system_len, a.question_len, vocab, a.seed)
    pool = pool_shape(a.conversations, a.turns, a.system_len, a.question_len, a.answer_len, a.block_size, a.ratio)
    engine = dict(
        block_size=a.block_size, num_kv_blocks=pool.num_kv_blocks, max_model_len=pool.max_model_len, seed=a.seed
    )
    rows, outputs = [], []
    for gib in (None, a.offload_gib) if a.order == "off-on" else (a.offload_gib, None):
        row, tokens, _ = _run(
            model_dir, system, questions, a.answer_len, gib, a.conversation_rate, a.think_time, **engine
        )
        row.working_set_blocks = pool.working_set_blocks
        rows.append(row)
        outputs.append(tokens)
    if a.order == "on-off":  # rows are reported off first
        rows.reverse()
    if outputs[0] != outputs[1]:
        raise SystemExit("greedy tokens differ with the tier on and off: no numbers")
    for row in rows:
        print(json.dumps(asdict(row)))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    return rows


if __name__ == "__main__":
    main()

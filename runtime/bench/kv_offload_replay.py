"""The host KV tier benchmark's workload (kv_offload.py) replayed through the real Scheduler and KVCacheManager
without a model: deterministic step counts where the bench's timings are noise (a shared machine).

The runner is a stand-in: every step it reports every load and save done (as executor/host_tier.py does) and
samples a token that depends only on the conversation, the turn and the position, so the tier on and off
produce the same answers and the same prompts on every later turn. What is real: admission, the token
budget, block allocation, prefix-cache hits and evictions, the tier's matches, loads and saves, preemption.

Per request: the step it was first scheduled in and the step of its first token, counted from its arrival
(a burst per turn arrives at the turn's first step). `queue_steps` = steps it waited before any of its
tokens was scheduled; `first_token_steps` = steps until its first token. With --conversation-rate the
arrivals need a clock: a linear step-cost model (`--step-cost-s A,B`: A seconds per step + B per scheduled
token) places them and gives model TTFTs. Those are the model's seconds, not measurements.

    python -m kvserve.runtime.bench.kv_offload_replay --conversations 16 --turns 3 --ratio 4

Pure Python (no torch): it runs in a second.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass, field

from kvserve.runtime import engine_args
from kvserve.runtime.bench.kv_offload import _workload, pool_shape
from kvserve.runtime.core.kv_cache_manager import KVCacheManager
from kvserve.runtime.core.outputs import ModelRunnerOutput
from kvserve.runtime.core.scheduler import Scheduler, SchedulerConfig
from kvserve.runtime.request import Request
from kvserve.runtime.sampling_params import SamplingParams

VOCAB = 49152  # SmolLM2's: the bench's default model (the token ids only feed the block hashes here)


@dataclass
class Replay:
    tier: bool
    num_kv_blocks: int
    working_set_blocks: int
    steps: int
    computed_tokens: int
    loaded_tokens: int
    preemptions: int
    # Over requests of turns 2.. (as the bench's TTFTs), the request at the p90 of first_token_steps (burst) or
    # of the model TTFT (paced):
    p50_first_token_steps: float
    p90_first_token_steps: float
    p90_queue_steps: int  # steps between its arrival and its first scheduled step
    p90_tokens_before: int  # tokens those steps computed (the prefills and decodes it waited behind)
    p90_tokens_to_first: int  # tokens of the steps from its first scheduled one to its first token (its prefill's)
    model_ttft_p50_s: float | None = None  # paced only: the step-cost model's seconds
    model_ttft_p90_s: float | None = None
    admissions: list[list[tuple[int, int]]] = field(default_factory=list)  # burst: per turn (step, admitted)
    answers: list[list[int]] = field(default_factory=list, repr=False)


def _token(conversation: int, turn: int, position: int) -> int:
    return 3 + (conversation * 7919 + turn * 104729 + position * 31) % (VOCAB - 3)


def replay(
    conversations: int = 16,
    turns: int = 3,
    system_len: int = 256,
    question_len: int = 64,
    answer_len: int = 32,
    ratio: float = 4.0,
    block_size: int = engine_args.default("block_size"),
    tier: bool = True,
    host_blocks: int | None = None,
    max_num_batched_tokens: int = engine_args.CHUNKED_PREFILL_BATCHED_TOKENS,
    preemption_mode: str = engine_args.default("preemption_mode"),
    rate: float | None = None,
    think_s: float = 0.0,
    step_cost_s: tuple[float, float] = (0.025, 0.001),
    seed: int = 0,
    num_kv_blocks: int | None = None,
) -> Replay:
    """host_blocks: the tier's size (default: the whole working set twice, as 1 GiB is for the real model).
    num_kv_blocks: the device pool, instead of the working set / ratio."""
    system, questions = _workload(conversations, turns, system_len, question_len, VOCAB, seed)
    pool = pool_shape(conversations, turns, system_len, question_len, answer_len, block_size, ratio)
    host = (host_blocks if host_blocks is not None else 2 * pool.working_set_blocks) if tier else 0
    num_kv_blocks = num_kv_blocks or pool.num_kv_blocks
    kv = KVCacheManager(num_kv_blocks, block_size, True, num_host_blocks=host, host_tier=tier)
    config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=pool.max_model_len,
        preemption_mode=preemption_mode,
    )
    scheduler = Scheduler(config, kv)
    params = SamplingParams(temperature=0.0, max_tokens=answer_len, ignore_eos=True)
    histories = [list(system) for _ in range(conversations)]
    answers: dict[str, list[int]] = {}
    asked: dict[str, tuple[int, int, Request, float, int]] = {}  # rid -> conv, turn, request, arrival s, step
    first_scheduled: dict[str, int] = {}
    step_tokens: list[int] = []  # tokens scheduled per step (step n is step_tokens[n - 1])
    rows: list[tuple[float, int, int, int]] = []  # turns 2..: (model TTFT, first token steps, queue steps, arrival)
    admissions: list[list[tuple[int, int]]] = [[] for _ in range(turns)]
    clock = 0.0
    due = {i: (i / rate if rate else 0.0) for i in range(conversations)}  # conversation -> its next turn's arrival
    next_turn = [0] * conversations

    def ask(i: int, at: float) -> None:
        turn = next_turn[i]
        request = Request(f"c{i}-t{turn}", histories[i] + questions[i][turn], params)
        asked[request.request_id] = (i, turn, request, at, len(step_tokens))
        answers[request.request_id] = []
        scheduler.add_request(request)

    while due or scheduler.has_unfinished_requests():
        if rate:
            for i, at in sorted(due.items(), key=lambda item: item[1]):
                if at <= clock:
                    ask(i, at)
                    del due[i]
            if not scheduler.has_unfinished_requests():
                clock = min(due.values())
                continue
        elif not scheduler.has_unfinished_requests():  # a burst: the next turn, all at once
            for i in sorted(due):
                ask(i, clock)
            due.clear()
        out = scheduler.schedule()
        step_tokens.append(sum(len(s.token_ids) for s in out.scheduled))
        clock += step_cost_s[0] + step_cost_s[1] * step_tokens[-1]
        for s in out.scheduled:
            if s.req_id not in first_scheduled:
                first_scheduled[s.req_id] = len(step_tokens)
                turn_admissions = admissions[asked[s.req_id][1]]
                since = len(step_tokens) - asked[s.req_id][4]
                if turn_admissions and turn_admissions[-1][0] == since:
                    turn_admissions[-1] = (since, turn_admissions[-1][1] + 1)
                else:
                    turn_admissions.append((since, 1))
        sampled = {
            s.req_id: _token(asked[s.req_id][0], asked[s.req_id][1], s.start_position + len(s.token_ids))
            for s in out.scheduled
            if s.sample
        }
        runner_output = ModelRunnerOutput(
            sampled, finished_sending=set(out.kv_connector.save), finished_receiving=set(out.kv_connector.load)
        )
        for result in scheduler.update_from_output(out, runner_output):
            i, turn, request, at, arrived = asked[result.req_id]
            if not answers[result.req_id] and turn:
                rows.append(
                    (clock - at, len(step_tokens) - arrived, first_scheduled[result.req_id] - arrived - 1, arrived)
                )
            answers[result.req_id] += result.new_token_ids
            if result.finish_reason is not None:
                histories[i] = request.prompt_token_ids + answers[result.req_id]
                next_turn[i] += 1
                if next_turn[i] < turns:
                    due[i] = clock + think_s
    key = 0 if rate else 1
    values = [r[key] for r in rows]
    p90 = statistics.quantiles(values, n=10)[8] if len(values) > 1 else values[0]
    at_p90 = min(rows, key=lambda r: abs(r[key] - p90))
    first_token_steps = [r[1] for r in rows]
    deciles = statistics.quantiles(first_token_steps, n=10) if len(rows) > 1 else [rows[0][1]] * 9
    return Replay(
        tier=tier,
        num_kv_blocks=num_kv_blocks,
        working_set_blocks=pool.working_set_blocks,
        steps=len(step_tokens),
        computed_tokens=sum(step_tokens),
        loaded_tokens=scheduler.num_offload_loaded_tokens,
        preemptions=scheduler.num_preemptions,
        p50_first_token_steps=statistics.median(first_token_steps),
        p90_first_token_steps=deciles[8],
        p90_queue_steps=at_p90[2],
        p90_tokens_before=sum(step_tokens[at_p90[3] : at_p90[3] + at_p90[2]]),
        p90_tokens_to_first=sum(step_tokens[at_p90[3] + at_p90[2] : at_p90[3] + at_p90[1]]),
        model_ttft_p50_s=statistics.median(r[0] for r in rows) if rate else None,
        model_ttft_p90_s=p90 if rate else None,
        admissions=[] if rate else admissions,
        answers=[answers[rid] for rid in sorted(answers)],
    )


def main(argv: list[str] | None = None) -> list[Replay]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-len", type=int, default=256)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--answer-len", type=int, default=32)
    ap.add_argument("--ratio", type=float, default=4.0, help="working set / device KV pool")
    ap.add_argument("--block-size", type=int, default=engine_args.default("block_size"))
    ap.add_argument("--num-kv-blocks", type=int, default=None, help="the device pool, instead of --ratio's")
    ap.add_argument(
        "--preemption-mode", choices=engine_args.PREEMPTION_MODES, default=engine_args.default("preemption_mode")
    )
    ap.add_argument("--conversation-rate", type=float, default=None)
    ap.add_argument("--think-time", type=float, default=0.0)
    ap.add_argument("--step-cost-s", default="0.025,0.001", help="paced only: A,B = A s per step + B s per token")
    a = ap.parse_args(argv)
    try:
        cost = tuple(float(x) for x in a.step_cost_s.split(","))
    except ValueError:
        cost = ()
    if len(cost) != 2:
        ap.error(f"--step-cost-s: expected A,B (seconds per step, per token), got {a.step_cost_s!r}")
    shape = dict(
        conversations=a.conversations,
        turns=a.turns,
        system_len=a.system_len,
        question_len=a.question_len,
        answer_len=a.answer_len,
        ratio=a.ratio,
        block_size=a.block_size,
        preemption_mode=a.preemption_mode,
        rate=a.conversation_rate,
        think_s=a.think_time,
        step_cost_s=cost,
        num_kv_blocks=a.num_kv_blocks,
    )
    off, on = replay(tier=False, **shape), replay(tier=True, **shape)
    if off.answers != on.answers:
        raise SystemExit("answers differ with the tier on and off: the replay is broken")
    for r in (off, on):
        row = asdict(r)
        del row["answers"]
        print(json.dumps(row))
    return [off, on]


if __name__ == "__main__":
    main()

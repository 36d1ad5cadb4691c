"""Warm-up before readiness (issue 43): one forward of each batch shape class, so that the first request does not
pay for what a first forward does once (oneDNN primitives and the allocator's pools on CPU, Triton compilation
and cuDNN/cuBLAS autotuning on CUDA, lazy module state): a prefill of one request, a decode of it, and a decode
batch of several requests (the captured decode graph of that size, with --cuda-graphs).

It runs through the executor (every rank) with requests the scheduler never sees: blocks 1.. of the KV cache are
written and then simply free, as after any finished request (prefix caching only reuses blocks a real request
computed and hashed). The requests are greedy (no RNG is drawn, so the seeded generators start where they did
without a warm-up) and the runner forgets them at the end. Bounded: no new shape starts after
KVSERVE_WARMUP_BUDGET_S seconds (default 10); KVSERVE_WARMUP=0 skips it. A warm-up that fails is logged and
skipped: it must never keep a server from starting that would serve.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from kvserve.runtime.core.block_table_diff import BlockTableDiff
from kvserve.runtime.core.outputs import NewRequestData, ScheduledRequest, SchedulerOutput
from kvserve.runtime.sampling_params import SamplingParams

logger = logging.getLogger("kvserve.warmup")

DEFAULT_BUDGET_S = 10.0
PREFILL_TOKENS = 32  # the prefill shape: a short prompt (capped by max_model_len and the token budget)
DECODE_BATCH = 8  # the batched-decode shape (capped by max_num_seqs and the free blocks)


def budget_s() -> float | None:
    """Seconds after which no new warm-up shape starts; None: warm-up off (KVSERVE_WARMUP=0)."""
    if os.environ.get("KVSERVE_WARMUP", "1") == "0":
        return None
    raw = os.environ.get("KVSERVE_WARMUP_BUDGET_S", str(DEFAULT_BUDGET_S))
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"KVSERVE_WARMUP_BUDGET_S must be a number of seconds, got {raw!r}") from None
    return value if value > 0 else None


def warm_up(executor: Any, config: Any, budget: float | None = None) -> list[str]:
    """Run the warm-up shapes on `executor`; the names of those that ran (logged with their seconds)."""
    limit = budget_s() if budget is None else budget
    if limit is None:
        return []
    bs = config.cache.block_size
    usable_blocks = executor.num_blocks - 1  # block 0 is the null block
    prefill = max(1, min(PREFILL_TOKENS, config.model.max_model_len - 1, config.scheduler.max_num_batched_tokens))
    first_blocks = -(-(prefill + 1) // bs)  # the prefill and its one decode token
    batch = max(0, min(DECODE_BATCH, config.scheduler.max_num_seqs - 1, usable_blocks - first_blocks))
    if first_blocks > usable_blocks:
        logger.info("warm-up skipped: the KV cache has %d usable blocks", usable_blocks)
        return []
    vocab = config.model.vocab_size
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    req = "warmup-0"
    prompt = [(7 * i + 3) % vocab for i in range(prefill)]
    blocks = list(range(1, first_blocks + 1))
    batch_ids = [f"warmup-{i + 1}" for i in range(batch)]
    shapes = [
        (
            f"prefill {prefill} tokens",
            SchedulerOutput(
                [ScheduledRequest(req, prompt, 0, BlockTableDiff(blocks, reset=True), sample=True)],
                [NewRequestData(req, greedy, prompt)],
                [],
            ),
        ),
        (
            "decode 1 sequence",
            SchedulerOutput([ScheduledRequest(req, [prompt[-1]], prefill, BlockTableDiff(), sample=True)], [], []),
        ),
    ]
    if batch > 1:
        first_free = first_blocks + 1
        shapes.append(
            (
                f"decode {batch} sequences",
                SchedulerOutput(
                    [
                        ScheduledRequest(rid, [prompt[i]], 0, BlockTableDiff([first_free + i], reset=True), sample=True)
                        for i, rid in enumerate(batch_ids)
                    ],
                    [NewRequestData(rid, greedy, [prompt[i]]) for i, rid in enumerate(batch_ids)],
                    [],
                ),
            )
        )
    started = time.monotonic()
    ran: list[str] = []
    timings: list[str] = []
    try:
        for name, step in shapes:
            if ran and time.monotonic() - started > limit:
                logger.info(
                    "warm-up stopped after %.2f s (KVSERVE_WARMUP_BUDGET_S=%g)", time.monotonic() - started, limit
                )
                break
            shape_started = time.monotonic()
            executor.execute(step)
            ran.append(name)
            timings.append(f"{name} {time.monotonic() - shape_started:.2f} s")
    except Exception as exc:  # noqa: BLE001 -- a server that can serve must not fail on its warm-up
        logger.warning(
            "warm-up failed and was skipped (%s: %s); the first request pays the first forward", type(exc).__name__, exc
        )
    finally:
        try:  # the runner forgets the warm-up requests (sampling state, block tables)
            executor.execute(SchedulerOutput([], [], [req, *batch_ids]))
        except Exception as exc:  # noqa: BLE001
            logger.warning("warm-up clean-up failed: %s", exc)
    if ran:
        logger.info("warm-up: %s", ", ".join(timings))
    return ran

"""How many micro-batches the engine core keeps in flight with pipeline parallelism (the loop itself is
EngineCore._step_pipelined).

KVSERVE_PP_BATCHES_IN_FLIGHT overrides the count (default: the stage count; 1 = one batch at a time, step()'s
lock-step loop), for measuring what the overlap buys (docs/multinode.md).
"""

from __future__ import annotations

import os

from kvserve.runtime.errors import InvalidParameter

BATCHES_IN_FLIGHT_ENV = "KVSERVE_PP_BATCHES_IN_FLIGHT"


def batches_in_flight(pipeline_parallel_size: int) -> int:
    """How many batches the engine keeps in flight: the stage count (vLLM's max_concurrent_batches), or
    $KVSERVE_PP_BATCHES_IN_FLIGHT; always 1 without pipelining."""
    if pipeline_parallel_size == 1:
        return 1
    raw = os.environ.get(BATCHES_IN_FLIGHT_ENV)
    if raw is None or raw.strip() == "":
        return pipeline_parallel_size
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise InvalidParameter(BATCHES_IN_FLIGHT_ENV, f"{BATCHES_IN_FLIGHT_ENV} must be an integer >= 1, got {raw!r}")
    return value

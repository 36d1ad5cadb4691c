"""Micro-batches in flight for pipeline parallelism: EngineCore.step() when pipeline_parallel_size > 1.

With one batch at a time, stage s idles while stages s+1.. run the batch and the engine applies its tokens:
a pipeline of P stages is busy 1/P of the time. vLLM's EngineCore.step_with_batch_queue keeps up to
max_concurrent_batches (= P) batches in flight; this is the same loop. Each call either

- schedules and launches a batch without waiting for it (MultiprocExecutor.submit), when fewer than `size`
  are in flight, and returns at once unless the queue is now full or its oldest batch is already back
  (filling the pipeline beats collecting); or
- waits for the oldest batch (collect), applies its output to the scheduler and returns its tokens -- when
  the queue is full or there was nothing to launch.

The scheduler skips requests whose batch is in flight and splits the active requests over `size` batches
(core/scheduler.py, micro_batches): a decode needs the token its previous batch samples, so the stages stay
busy only with at least `size` requests. Every rank runs the batches in launch order, so stage s writes a
layer's KV for batch n before it reads it for batch n+1 (prefix-cache hits on blocks another in-flight batch
is filling are therefore safe), and the block-table diffs are applied in the order they were computed.

Failure semantics are step()'s: a dead worker is a WorkerDiedError (the core is dead); anything else failing
around one batch fails that batch's requests (retryably), and too many such failures in a row kill the core.
Only the batch-level logic lives here; EngineCore keeps the requests and counters. Not composable with
speculative decoding or LoRA (the config refuses both with pipeline_parallel_size > 1), so neither the
proposer nor the LoRA lock appears here.

KVSERVE_PP_BATCHES_IN_FLIGHT overrides the queue size (default: the stage count; 1 = one batch at a time,
step()'s lock-step loop), for measuring what the overlap buys (docs/multinode.md).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque

from kvserve.runtime.core.outputs import SchedulerOutput
from kvserve.runtime.engine.core_messages import EngineCoreOutputs, SampleDelta
from kvserve.runtime.errors import InvalidParameter, WorkerDiedError, request_failed

logger = logging.getLogger("kvserve.engine")

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


class BatchQueue:
    def __init__(self, core, size: int):
        self.core = core
        self.size = size
        self.batches: deque[tuple[SchedulerOutput, int]] = deque()  # (what was launched, executor handle)
        self.max_in_flight = 0  # the most batches that were in flight at once (tests, debugging)

    def step(self) -> EngineCoreOutputs:
        core = self.core
        if core.dead_error is not None:
            raise core.dead_error
        batches, first_scheduled = self.batches, []
        if len(batches) < self.size:
            try:
                sched_out = core.scheduler.schedule()
            except Exception:  # noqa: BLE001 -- no batch to blame: step() fails every request too
                logger.exception("engine step failed while scheduling; failing the unfinished requests")
                return core._fail_step(None)
            if (
                sched_out.scheduled
                or sched_out.swap_out
                or sched_out.swap_in
                or (sched_out.finished_req_ids and not batches)
            ):
                first_scheduled = self._first_scheduled(sched_out)
                try:
                    handle = core.runner.submit(sched_out)
                except WorkerDiedError as exc:
                    core.dead_error = exc
                    raise
                except Exception:  # noqa: BLE001 -- e.g. the batch did not pickle: fail its requests
                    logger.exception("launching a batch failed; failing the requests scheduled in it")
                    core.scheduler.release_in_flight(sched_out)
                    return self._failed(sched_out, first_scheduled)
                batches.append((sched_out, handle))
                self.max_in_flight = max(self.max_in_flight, len(batches))
                if len(batches) < self.size and not core.runner.is_done(batches[0][1]):
                    return EngineCoreOutputs([], [], first_scheduled, None, core.num_step_failures)
            elif sched_out.finished_req_ids:  # nothing to run: tell the ranks with the next batch
                core.scheduler.requeue_finished(sched_out.finished_req_ids)
        if not batches:
            return EngineCoreOutputs([], [], first_scheduled, None, core.num_step_failures)
        return self._apply_oldest(first_scheduled)

    def _apply_oldest(self, first_scheduled: list[tuple[str, float]]) -> EngineCoreOutputs:
        core = self.core
        sched_out, handle = self.batches.popleft()
        try:
            runner_out = core.runner.collect(handle)
            core_outputs = core.scheduler.update_from_output(sched_out, runner_out)
        except WorkerDiedError as exc:  # the ranks cannot be brought back in step: fatal
            core.dead_error = exc
            raise
        except Exception:  # noqa: BLE001 -- no single request to blame
            logger.exception("engine step failed; failing the requests of the batch")
            core.scheduler.release_in_flight(sched_out)
            return self._failed(sched_out, first_scheduled)
        core.num_consecutive_step_failures = 0

        # As step() turns one step's output into deltas and failures.
        failed = {rid: request_failed(stage) for rid, stage in runner_out.failed.items()}
        requests, deltas = core._requests, []
        for out in core_outputs:
            entry = requests.get(out.req_id)
            if entry is None or out.req_id in failed:
                continue
            if entry.num_prompt_tokens:
                core.prompt_tokens += entry.num_prompt_tokens
                entry.num_prompt_tokens = 0
            core.generation_tokens += len(out.new_token_ids)
            deltas.append(
                SampleDelta(out.req_id, out.new_token_ids, out.new_logprobs, out.finish_reason, out.stop_reason)
            )
            if out.finish_reason is not None:
                del requests[out.req_id]
        failures = [core.fail_request(rid, error) for rid, error in failed.items() if rid in requests]
        return EngineCoreOutputs(deltas, failures, first_scheduled, None, core.num_step_failures)

    def _first_scheduled(self, sched_out: SchedulerOutput) -> list[tuple[str, float]]:
        """(request id, time) of the requests this batch schedules for the first time (queue-time metrics)."""
        now, first = time.monotonic(), []
        for scheduled in sched_out.scheduled:
            entry = self.core._requests.get(scheduled.req_id)
            if entry is not None and not entry.scheduled:
                entry.scheduled = True
                first.append((scheduled.req_id, now))
        return first

    def _failed(self, sched_out: SchedulerOutput, first_scheduled: list[tuple[str, float]]) -> EngineCoreOutputs:
        out = self.core._fail_step([s.req_id for s in sched_out.scheduled])
        out.first_scheduled = first_scheduled
        return out

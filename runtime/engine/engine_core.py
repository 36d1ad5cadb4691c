"""EngineCore: the scheduler, the KV-cache manager and the executor (executor/base.py: the model in this
process, or one worker process per rank), and the failure semantics of a step. Token ids in, per-step
token-id deltas out (core_messages.EngineCoreOutputs); no tokenizer work on its critical path: detokenisation
and stop strings belong to the front (LLMEngine in-process, or the API-server process through
core_client.CoreClient).

A core request is one sequence; n > 1 samples arrive as n requests (engine/parent_request.py fans them out
in front and merges their outputs).

Failure semantics (engine/errors.py): a request the core cannot serve is refused by `add_request`
(InvalidParameter); inside a step, what fails for one request fails that request alone (`fail_request`: its
blocks freed, a RequestFailure reported); a step failure no request explains fails the requests in that
step with a retryable error (`_fail_step`); a dead tensor-parallel worker or `max_consecutive_step_failures`
failed steps in a row make the core dead (`dead_error`, raised by every later call)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvserve.runtime.config import EngineConfig
from kvserve.runtime.core.kv_cache_manager import KVCacheManager
from kvserve.runtime.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from kvserve.runtime.core.pd_connector import PDConnector, PDEndpoint
from kvserve.runtime.core.scheduler import Scheduler
from kvserve.runtime.engine.batch_queue import batches_in_flight
from kvserve.runtime.engine.core_messages import EngineCoreOutputs, RequestFailure, SampleDelta
from kvserve.runtime.errors import (
    STEP_FAILED,
    EngineDeadError,
    InvalidParameter,
    RequestError,
    WorkerDiedError,
    request_failed,
)
from kvserve.runtime.executor import kv_sizing, warmup
from kvserve.runtime.executor.base import Executor, create_executor
from kvserve.runtime.executor.remote_store import open_lower_tiers
from kvserve.runtime.kv_events.step import make_step_publisher
from kvserve.runtime.outputs import EngineStats
from kvserve.runtime.request import Request, RequestStatus
from kvserve.runtime.sampling_params import RequestLimits, SamplingParams
from kvserve.runtime.startup_phases import timed

if TYPE_CHECKING:
    from kvserve.runtime.lora.registry import LoraRegistry
    from kvserve.runtime.spec_decode.proposer import DraftProposer

logger = logging.getLogger("kvserve.engine")


@dataclass
class _CoreRequest:
    num_prompt_tokens: int  # to add to prompt_tokens with the request's first output (then 0)
    scheduled: bool = False
    lora_name: str | None = None  # the adapter it runs with (an unloaded adapter stays until its last request)


class EngineCore:
    def __init__(self, config: EngineConfig, tokenizer_vocab_size: int | None = None):
        from kvserve.runtime.engine.step_log import StepLog

        # Called after every step as observer(scheduled, seconds): what the step computed and how long it took.
        # KVSERVE_STEP_LOG adds a file writer (step_log.py); `kvserve calibrate` adds its profiler.
        self.step_observers: list = []
        log = StepLog.from_env()
        if log is not None:
            self.step_observers.append(log.record)
        # Pipeline parallelism: step() keeps this many micro-batches in flight (_step_pipelined); checked
        # before any worker starts.
        self.batch_slots = batches_in_flight(config.pipeline_parallel_size)
        self.batches: deque[tuple[SchedulerOutput, int]] = deque()  # (what was launched, executor handle)
        self.max_batches_in_flight = 0  # the most batches that were in flight at once (tests, debugging)
        self.executor: Executor = create_executor(config)
        with timed(self.executor.startup_phases, "warmup"):  # a first forward of each shape class, before ready
            warmup.warm_up(self.executor, config)
        self.config = config = replace(
            config,
            cache=replace(
                config.cache, num_blocks=self.executor.num_blocks, kv_block_layout=self.executor.kv_block_layout
            ),
        )
        self.kv_cache_manager = KVCacheManager(
            self.executor.num_blocks,
            config.cache.block_size,
            config.cache.enable_prefix_caching,
            num_host_blocks=self.executor.num_host_blocks,
            group_windows=kv_sizing.layout(config).group_windows,
            host_tier=config.cache.kv_offloading_bytes > 0,
            disk_index=open_lower_tiers(config, self.executor),  # the disk and/or remote tiers, or None
        )
        self.scheduler = Scheduler(
            config.scheduler, self.kv_cache_manager, micro_batches=self.batch_slots, pd=self._pd_connector(config)
        )
        # --kv-events-config: the cache's stored/removed blocks, one batch per step (runtime/kv_events/)
        self.kv_events = make_step_publisher(config.kv_events, self.kv_cache_manager.pool)
        self.lora_registry: LoraRegistry | None = None  # --enable-lora: the served adapters (lora/registry.py)
        self._model_lock = contextlib.nullcontext()  # held while a step runs the model
        if self.executor.lora is not None:
            from kvserve.runtime.lora.registry import LoraRegistry

            self.lora_registry = LoraRegistry(
                self.executor.lora, config.lora.max_lora_rank, config.lora.modules, self._lora_requests
            )
            self._model_lock = self.lora_registry.lock
        # --speculative-config: drafts for the running requests before each schedule
        self.proposer: DraftProposer | None = None
        if config.speculative is not None:
            if config.speculative.method == "draft_model":  # a draft model here, beside the target's executor
                from kvserve.runtime.executor.draft_model import DraftModelProposer

                self.proposer = DraftModelProposer(config, self.executor.num_blocks)
            else:
                from kvserve.runtime.spec_decode.proposer import Proposer

                self.proposer = Proposer(config.speculative, config.model.max_model_len)
        self.eos_token_ids = frozenset(config.model.eos_token_ids)
        vocab = (
            config.model.vocab_size
            if tokenizer_vocab_size is None
            else min(config.model.vocab_size, tokenizer_vocab_size)
        )
        self.limits = RequestLimits(
            vocab_size=vocab,
            max_model_len=config.model.max_model_len,
            max_num_seqs=config.scheduler.max_num_seqs,
            block_size=config.cache.block_size,
            num_usable_blocks=self.executor.num_blocks - 1,
        )
        self._requests: dict[str, _CoreRequest] = {}  # unfinished requests
        self.sleep_level = 0  # --enable-sleep-mode: 0 awake, else asleep at that level (engine/sleep_control.py)
        self.sleep_guard = threading.Lock()  # the sleep call's "no requests" check vs add_request
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_step_failures = 0  # steps that failed as a whole (cumulative, for metrics)
        self.num_consecutive_step_failures = 0
        self.dead_error: BaseException | None = None

    # -- requests -------------------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        count_prompt_tokens: bool = True,
    ) -> None:
        """Queue one sequence the front verified (engine/front.py: the core does not verify it again). params
        must have n=1 (the front fans n > 1 out into child requests) and carry its compiled grammar if it has a
        structured-output spec (the front compiles). Checked here only what only the core knows: its live ids
        and the adapters it serves now. count_prompt_tokens: whether prompt_tokens counts this request's
        prompt (False for the 2nd.. child of an n > 1 request)."""
        if self.dead_error is not None:
            raise self.dead_error
        if request_id in self._requests:
            raise InvalidParameter("request_id", f"request id {request_id!r} is already in use")
        with self.sleep_guard:
            if self.sleep_level:
                raise InvalidParameter("request", "the engine is asleep (sleep mode): POST /wake_up first")
            self._add_request(request_id, prompt_token_ids, params, arrival_time, count_prompt_tokens)

    def _add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        count_prompt_tokens: bool,
    ) -> None:
        if params.n != 1:
            raise InvalidParameter(
                "n",
                f"the engine core runs one sequence per request, got n={params.n} "
                "(the front fans n > 1 out: engine/parent_request.py)",
            )
        lora_name, lora_identity = self._lora(params.lora_name)
        self._requests[request_id] = _CoreRequest(len(prompt_token_ids) if count_prompt_tokens else 0, False, lora_name)
        self.scheduler.add_request(
            Request(
                request_id,
                prompt_token_ids,
                params,
                self.eos_token_ids,
                arrival_time,
                lora_name=lora_name,
                lora_identity=lora_identity,
            )
        )

    def _lora(self, name: str | None) -> tuple[str | None, str | None]:
        """(adapter name, content identity) for a request's lora_name; InvalidParameter for an unknown one."""
        if name is None:
            return None, None
        identity = self.lora_registry.identity(name) if self.lora_registry is not None else None
        if identity is None:
            raise InvalidParameter("model", f"the model {name!r} does not exist (no such LoRA adapter)")
        return name, identity

    def _lora_requests(self, name: str) -> int:
        """Unfinished requests using adapter `name` (list(): a load thread may ask while this thread adds)."""
        return sum(1 for r in list(self._requests.values()) if r.lora_name == name)

    def abort_request(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is not None:
            self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
            if self.lora_registry is not None:
                self.lora_registry.reap()

    def finish_stopped(self, request_ids: list[str]) -> None:
        """The front found a stop string in these requests: finish them (blocks freed) as stopped."""
        live = [rid for rid in request_ids if self._requests.pop(rid, None) is not None]
        if live:
            self.scheduler.finish_requests(live, RequestStatus.FINISHED_STOPPED)
            if self.lora_registry is not None:
                self.lora_registry.reap()

    def _pd_connector(self, config: EngineConfig) -> PDConnector | None:
        """--kv-transfer-config: the scheduler's half of P/D disaggregation (core/pd_connector.py)."""
        kt = config.kv_transfer
        if kt is None:
            return None
        endpoint = None
        if kt.is_producer:
            endpoint = PDEndpoint(kt.engine_id, kt.side_channel_host, kt.side_channel_port, config.tensor_parallel_size)
        return PDConnector(endpoint, self.kv_cache_manager.pool, config.cache.block_size, kt.abort_request_timeout_s)

    def has_unfinished_requests(self) -> bool:
        # A batch still in flight (its requests since aborted, say) is collected by the next steps; P/D leases
        # and pulls end only in steps (the runner polls NIXL there).
        return bool(self._requests) or bool(self.batches) or self.scheduler.has_kv_transfers

    def is_unfinished(self, request_id: str) -> bool:
        return request_id in self._requests

    def check_health(self) -> None:
        """Raise the core's fatal error if it is dead (cheap: no I/O)."""
        if self.dead_error is not None:
            raise self.dead_error
        try:
            self.executor.check_health()
        except WorkerDiedError as exc:
            self.dead_error = exc
            raise

    def shutdown(self) -> None:
        if self.kv_events is not None:
            self.kv_events.shutdown()
        self.executor.shutdown()

    # -- one step ---------------------------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        try:
            return self._step()
        finally:
            if self.kv_events is not None:
                self.kv_events.publish_step()

    def _step(self) -> EngineCoreOutputs:
        if self.dead_error is not None:
            raise self.dead_error
        if self.batch_slots > 1:  # pipeline parallelism: micro-batches in flight
            return self._step_pipelined()
        scheduled_ids: list[str] | None = None  # None until the scheduler has picked this step's requests
        first_scheduled: list[tuple[str, float]] = []
        step_start = time.perf_counter() if self.step_observers else 0.0
        try:
            if self.proposer is not None:
                self.proposer.propose(self.scheduler.running)
            sched_out = self.scheduler.schedule()
            if self.proposer is not None:
                self.proposer.attach_draft_probs(sched_out)  # draft_model: q of sampled drafts, for the verifier
            scheduled_ids = [s.req_id for s in sched_out.scheduled]
            first_scheduled = self._first_scheduled(sched_out)
            with self._model_lock:  # a LoRA load registers between steps, never inside one
                runner_out = self.executor.execute(sched_out)
            core_outputs = self.scheduler.update_from_output(sched_out, runner_out)
            if self.step_observers:
                seconds = time.perf_counter() - step_start
                for observe in self.step_observers:
                    observe(sched_out.scheduled, seconds)
        except WorkerDiedError as exc:  # the ranks cannot be brought back in step: fatal
            self.dead_error = exc
            raise
        except Exception:  # noqa: BLE001 -- e.g. the forward: no single request to blame
            logger.exception("engine step failed; failing the requests scheduled in it")
            return self._fail_step(scheduled_ids)
        out = self._step_outputs(runner_out, core_outputs, first_scheduled)
        if self.lora_registry is not None:
            self.lora_registry.reap()
        return out

    def _step_pipelined(self) -> EngineCoreOutputs:
        """step() with up to batch_slots micro-batches in flight (pipeline parallelism).

        With one batch at a time, stage s idles while stages s+1.. run the batch and the engine applies its
        tokens: a pipeline of P stages is busy 1/P of the time. vLLM's EngineCore.step_with_batch_queue keeps
        up to max_concurrent_batches (= P) batches in flight; this is the same loop. Each call either

        - schedules and launches a batch without waiting for it (Executor.submit), when fewer than
          batch_slots are in flight, and returns at once unless the queue is now full or its oldest batch is
          already back (filling the pipeline beats collecting); or
        - waits for the oldest batch (collect), applies its output to the scheduler and returns its tokens --
          when the queue is full or there was nothing to launch.

        The scheduler skips requests whose batch is in flight and splits the active requests over the slots
        (core/scheduler.py, micro_batches): a decode needs the token its previous batch samples, so the stages
        stay busy only with at least batch_slots requests. Every rank runs the batches in launch order, so
        stage s writes a layer's KV for batch n before it reads it for batch n+1 (prefix-cache hits on blocks
        another in-flight batch is filling are therefore safe), and the block-table diffs are applied in the
        order they were computed. Failure semantics are step()'s, per batch. Not composable with speculative
        decoding or LoRA (the config refuses both with pipeline_parallel_size > 1), so neither the proposer
        nor the LoRA lock appears here."""
        batches, first_scheduled = self.batches, []
        if len(batches) < self.batch_slots:
            try:
                sched_out = self.scheduler.schedule()
            except Exception:  # noqa: BLE001 -- no batch to blame: step() fails every request too
                logger.exception("engine step failed while scheduling; failing the unfinished requests")
                return self._fail_step(None)
            if (
                sched_out.scheduled
                or sched_out.swap_out
                or sched_out.swap_in
                or (sched_out.finished_req_ids and not batches)
            ):
                first_scheduled = self._first_scheduled(sched_out)
                try:
                    handle = self.executor.submit(sched_out)
                except WorkerDiedError as exc:
                    self.dead_error = exc
                    raise
                except Exception:  # noqa: BLE001 -- e.g. the batch did not pickle: fail its requests
                    logger.exception("launching a batch failed; failing the requests scheduled in it")
                    return self._fail_batch(sched_out, first_scheduled)
                batches.append((sched_out, handle))
                self.max_batches_in_flight = max(self.max_batches_in_flight, len(batches))
                if len(batches) < self.batch_slots and not self.executor.is_done(batches[0][1]):
                    return EngineCoreOutputs([], [], first_scheduled, None, self.num_step_failures)
            elif sched_out.finished_req_ids:  # nothing to run: tell the ranks with the next batch
                self.scheduler.requeue_finished(sched_out.finished_req_ids)
        if not batches:
            return EngineCoreOutputs([], [], first_scheduled, None, self.num_step_failures)
        sched_out, handle = batches.popleft()
        try:
            runner_out = self.executor.collect(handle)
            core_outputs = self.scheduler.update_from_output(sched_out, runner_out)
        except WorkerDiedError as exc:  # the ranks cannot be brought back in step: fatal
            self.dead_error = exc
            raise
        except Exception:  # noqa: BLE001 -- no single request to blame
            logger.exception("engine step failed; failing the requests of the batch")
            return self._fail_batch(sched_out, first_scheduled)
        return self._step_outputs(runner_out, core_outputs, first_scheduled)

    def _first_scheduled(self, sched_out: SchedulerOutput) -> list[tuple[str, float]]:
        """(request id, time) of the requests this step schedules for the first time (queue-time metrics)."""
        now, first = time.monotonic(), []
        for scheduled in sched_out.scheduled:
            entry = self._requests.get(scheduled.req_id)
            if entry is not None and not entry.scheduled:
                entry.scheduled = True
                first.append((scheduled.req_id, now))
        return first

    def _step_outputs(
        self,
        runner_out: ModelRunnerOutput,
        core_outputs: list[EngineCoreOutput],
        first_scheduled: list[tuple[str, float]],
    ) -> EngineCoreOutputs:
        """One completed step (or micro-batch) as the front sees it: token deltas, and the requests whose own
        sampling failed, failed alone."""
        self.num_consecutive_step_failures = 0
        failed = {rid: request_failed(stage) for rid, stage in runner_out.failed.items()}  # their own failures
        requests, deltas = self._requests, []
        for out in core_outputs:
            entry = requests.get(out.req_id)
            if entry is None or out.req_id in failed:
                continue
            if entry.num_prompt_tokens:
                self.prompt_tokens += entry.num_prompt_tokens
                entry.num_prompt_tokens = 0
            self.generation_tokens += len(out.new_token_ids)
            deltas.append(
                SampleDelta(
                    out.req_id,
                    out.new_token_ids,
                    out.new_logprobs,
                    out.finish_reason,
                    out.stop_reason,
                    out.kv_transfer_params,
                )
            )
            if out.finish_reason is not None:
                del requests[out.req_id]
        failures = [self.fail_request(rid, error) for rid, error in failed.items() if rid in requests]
        return EngineCoreOutputs(deltas, failures, first_scheduled, None, self.num_step_failures)

    def _fail_batch(self, sched_out: SchedulerOutput, first_scheduled: list[tuple[str, float]]) -> EngineCoreOutputs:
        """A micro-batch failed as a whole: its requests leave the in-flight set and fail as in _fail_step."""
        self.scheduler.release_in_flight(sched_out)
        out = self._fail_step([s.req_id for s in sched_out.scheduled])
        out.first_scheduled = first_scheduled
        return out

    def fail_request(self, request_id: str, error: RequestError) -> RequestFailure:
        """Finish one request with an error: free its blocks now."""
        self.abort_request(request_id)
        return RequestFailure(request_id, error.message, error.retryable)

    def _fail_step(self, scheduled_ids: list[str] | None) -> EngineCoreOutputs:
        """A step failed as a whole: fail (retryably) the requests it ran -- every request if the scheduler
        itself failed -- and declare the core dead after too many such steps in a row. Aborting frees the
        blocks the step was filling and drops their prefix-cache entries (their KV was never written)."""
        self.num_step_failures += 1
        self.num_consecutive_step_failures += 1
        limit = self.config.max_consecutive_step_failures
        if scheduled_ids is None:
            affected = list(self._requests)
        else:
            affected = [rid for rid in scheduled_ids if rid in self._requests]
        failures = [self.fail_request(rid, STEP_FAILED) for rid in affected]
        if self.num_consecutive_step_failures >= limit:
            self.dead_error = EngineDeadError(
                f"the engine is dead after {self.num_consecutive_step_failures} consecutive failed steps "
                f"(max_consecutive_step_failures={limit}); retry on another replica"
            )
            logger.error("%s", self.dead_error)
            raise self.dead_error
        return EngineCoreOutputs([], failures, [], None, self.num_step_failures)

    def get_stats(self) -> EngineStats:
        kv = self.kv_cache_manager
        running_loras = waiting_loras = None
        if self.scheduler.config.max_loras:
            running_loras, waiting_loras = self.scheduler.lora_adapters()
        return EngineStats(
            num_requests_running=self.scheduler.num_running,
            num_requests_waiting=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.pool.num_blocks - 1,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_swap_outs=self.scheduler.num_swap_outs,
            num_swap_ins=self.scheduler.num_swap_ins,
            num_swapped_out_blocks=kv.num_swapped_out_blocks,
            num_swapped_in_blocks=kv.num_swapped_in_blocks,
            num_free_host_blocks=kv.num_free_host_blocks,
            num_total_host_blocks=kv.num_host_blocks,
            running_lora_adapters=running_loras,
            waiting_lora_adapters=waiting_loras,
            spec_num_drafts=self.scheduler.spec_num_drafts,
            spec_num_draft_tokens=self.scheduler.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.scheduler.spec_num_accepted_tokens,
            spec_accepted_per_pos=tuple(self.scheduler.spec_accepted_per_pos),
            **kv.offload_stats(self.executor.kv_cache_bytes // self.executor.num_blocks * self.config.world_size),
            **(self.kv_events.stats() if self.kv_events is not None else {}),
            **(self.scheduler.pd.stats() if self.scheduler.pd is not None else {}),
        )

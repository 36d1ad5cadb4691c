"""LLMEngine: requests in, one scheduler + model step at a time, RequestOutputs out. Not thread-safe:
the async server drives it from one thread.

Failure semantics (engine/errors.py): a request the engine cannot serve is refused by `add_request`
(InvalidParameter, via sampling_params.verify_request); inside a step, what fails for one request fails that
request alone (`_fail_request`: its blocks freed, an output with `error` set); a step failure no request
explains fails the requests in that step with a retryable error (`_fail_step`); a dead tensor-parallel worker
or `max_consecutive_step_failures` failed steps in a row make the engine dead (`dead_error`, raised by every
later call)."""
from __future__ import annotations

import logging
import time

from kvserve.runtime.config import EngineConfig, make_engine_config
from kvserve.runtime.core.kv_cache_manager import KVCacheManager
from kvserve.runtime.core.scheduler import Scheduler
from kvserve.runtime.engine.errors import STEP_FAILED, EngineDeadError, RequestError, request_failed
from kvserve.runtime.engine.output_processor import OutputProcessor, RequestState
from kvserve.runtime.outputs import EngineStats, RequestOutput
from kvserve.runtime.parallel.errors import WorkerDiedError
from kvserve.runtime.request import Request, RequestStatus
from kvserve.runtime.worker import kv_sizing
from kvserve.runtime.sampling_params import (InvalidParameter, RequestLimits, SamplingParams, is_valid_text,
                                             verify_request)

logger = logging.getLogger("kvserve.engine")

PromptInput = str | list[int] | dict


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from kvserve.runtime.worker.model_runner import ModelRunner

        self.tokenizer = load_tokenizer(config.model.model_dir)
        if config.tensor_parallel_size > 1:  # one worker process per rank; this process only schedules
            from kvserve.runtime.parallel.executor import MultiprocExecutor

            self.runner = MultiprocExecutor(config)
        else:
            self.runner = ModelRunner(config)
        self.config = _with_num_blocks(config, self.runner.num_blocks)
        self.kv_cache_manager = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                               config.cache.enable_prefix_caching,
                                               num_host_blocks=self.runner.num_host_blocks,
                                               group_windows=kv_sizing.layout(config).group_windows)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.eos_token_ids = frozenset(config.model.eos_token_ids)
        self._states: dict[str, RequestState] = {}  # public request id -> state
        self._sample_owner: dict[str, tuple[RequestState, int]] = {}  # internal sample id -> (state, index)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._grammar_compiler = None
        self.limits = RequestLimits(
            vocab_size=min(config.model.vocab_size, len(self.tokenizer)), max_model_len=config.model.max_model_len,
            max_num_seqs=config.scheduler.max_num_seqs, block_size=config.cache.block_size,
            num_usable_blocks=self.runner.num_blocks - 1)
        self.num_step_failures = 0  # steps that failed as a whole (cumulative, for metrics)
        self.num_consecutive_step_failures = 0
        self.dead_error: BaseException | None = None
        m, c = self.config.model, self.config.cache
        logger.info("engine ready: %s, max_model_len=%d, %d KV blocks x %d tokens (%.1f MiB), prefix caching %s, "
                    "chunked prefill %s, attention=%s, device=%s", m.architecture, m.max_model_len, c.num_blocks - 1,
                    c.block_size, self.runner.kv_cache_bytes / 2**20, c.enable_prefix_caching,
                    self.config.scheduler.enable_chunked_prefill, self.config.attention_backend, self.config.device)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "LLMEngine":
        return cls(make_engine_config(model, **kwargs))

    # -- requests -------------------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise InvalidParameter("prompt", "prompt_token_ids must be a list of token ids")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidParameter("prompt", "a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not is_valid_text(prompt):
                raise InvalidParameter("prompt", "prompt is not valid Unicode text (it holds lone surrogates)")
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise InvalidParameter("prompt", f"prompt must be a string, a list of token ids or a dict, "
                                         f"got {type(prompt).__name__}")

    def verify(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidParameter (naming the field) if this engine can never serve the request."""
        if not isinstance(params, SamplingParams):
            raise InvalidParameter("sampling_params", f"sampling_params must be a SamplingParams, "
                                                      f"got {type(params).__name__}")
        verify_request(prompt_token_ids, params, self.limits)

    @property
    def grammar_compiler(self):
        """Compiles structured-output specs for this model (created on first use: xgrammar loads lazily)."""
        if self._grammar_compiler is None:
            from kvserve.runtime.structured_output.compiler import GrammarCompiler

            m = self.config.model
            self._grammar_compiler = GrammarCompiler(self.tokenizer, m.model_dir, m.vocab_size, m.eos_token_ids)
        return self._grammar_compiler

    def compile_constraint(self, params: SamplingParams) -> SamplingParams:
        """params with its structured-output grammar compiled (a copy; the same object when there is none)."""
        if params.structured_outputs is None or params.compiled_constraint is not None:
            return params
        from dataclasses import replace

        return replace(params, compiled_constraint=self.grammar_compiler.compile(params.structured_outputs))

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        params = self.compile_constraint(params or SamplingParams())
        if request_id in self._states:
            raise InvalidParameter("request_id", f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        self.verify(token_ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        sample_ids = [f"{request_id}#{i}" for i in range(params.n)]
        samples = [Request(sid, token_ids, params.for_sample(i) if params.n > 1 else params, self.eos_token_ids,
                           arrival) for i, sid in enumerate(sample_ids)]
        leader = samples[0]
        leader.fork_children = samples[1:]
        state = RequestState(request_id, text, token_ids, params, sample_ids, arrival)
        self._states[request_id] = state
        for i, sid in enumerate(sample_ids):
            self._sample_owner[sid] = (state, i)
        self.scheduler.add_request(leader)

    def abort_request(self, request_id: str) -> None:
        state = self._states.get(request_id)
        if state is None:
            return
        self.scheduler.finish_requests(state.sample_ids, RequestStatus.FINISHED_ABORTED)
        self._forget(state)

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def check_health(self) -> None:
        """Raise the engine's fatal error if it is dead (a tensor-parallel worker gone: WorkerDiedError
        naming the rank; too many failed steps: EngineDeadError). Cheap: the server calls it while idle."""
        if self.dead_error is not None:
            raise self.dead_error
        check = getattr(self.runner, "check_health", None)
        if check is not None:
            try:
                check()
            except WorkerDiedError as exc:
                self.dead_error = exc
                raise

    def shutdown(self) -> None:
        """Release the tensor-parallel worker processes (idempotent; nothing to do in one process)."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    # -- one step ---------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.dead_error is not None:
            raise self.dead_error
        scheduled_ids: list[str] | None = None  # None until the scheduler has picked this step's requests
        try:
            sched_out = self.scheduler.schedule()
            scheduled_ids = [s.req_id for s in sched_out.scheduled]
            now = time.monotonic()
            for scheduled in sched_out.scheduled:
                owner = self._sample_owner.get(scheduled.req_id)
                if owner is not None and owner[0].metrics.first_scheduled_time is None:
                    owner[0].metrics.first_scheduled_time = now
            runner_out = self.runner.execute(sched_out)
            core_outputs = self.scheduler.update_from_output(sched_out, runner_out)
        except WorkerDiedError as exc:  # the ranks cannot be brought back in step: fatal
            self.dead_error = exc
            raise
        except Exception:  # noqa: BLE001 -- e.g. the forward: no single request to blame
            logger.exception("engine step failed; failing the requests scheduled in it")
            return self._fail_step(scheduled_ids)
        self.num_consecutive_step_failures = 0

        failed: dict[str, RequestError] = {}  # public request id -> its own failure
        for sample_id, stage in runner_out.failed.items():
            owner = self._sample_owner.get(sample_id)
            if owner is not None:
                failed.setdefault(owner[0].request_id, request_failed(stage))
        touched: dict[str, RequestState] = {}
        for out in core_outputs:
            owner = self._sample_owner.get(out.req_id)
            if owner is None or owner[0].request_id in failed:
                continue
            state, index = owner
            try:
                if index == 0 and not state.samples[0].token_ids:
                    self.prompt_tokens += len(state.prompt_token_ids)
                self.generation_tokens += len(out.new_token_ids)
                if self.output_processor.process(state, index, out) is not None:  # hit a stop string
                    self.scheduler.finish_requests([out.req_id], RequestStatus.FINISHED_STOPPED)
            except Exception:  # noqa: BLE001 -- detokenisation / stop checks of this request only
                logger.exception("output processing failed for request %s; failing it alone", state.request_id)
                failed[state.request_id] = request_failed("detokenizing the output or checking stop strings")
                continue
            touched[state.request_id] = state
        outputs = [self._fail_request(self._states[rid], error) for rid, error in failed.items()
                   if rid in self._states]
        for state in touched.values():
            if state.request_id in failed:
                continue
            if state.finished:
                state.metrics.finished_time = time.monotonic()
                self._forget(state)
            outputs.append(state.to_output())
        return outputs

    def _fail_request(self, state: RequestState, error: RequestError) -> RequestOutput:
        """Finish one request with an error: free its blocks now, report it (finish_reason "error")."""
        self.scheduler.finish_requests(state.sample_ids, RequestStatus.FINISHED_ABORTED)
        self._forget(state)
        for sample in state.samples:
            if sample.finish_reason is None:
                sample.finish_reason = "error"
        state.metrics.finished_time = time.monotonic()
        output = state.to_output()
        output.error = error
        return output

    def _fail_step(self, scheduled_ids: list[str] | None) -> list[RequestOutput]:
        """A step failed as a whole: fail (retryably) the requests it ran -- every request if the scheduler
        itself failed -- and declare the engine dead after too many such steps in a row. Aborting frees the
        blocks the step was filling and drops their prefix-cache entries (their KV was never written)."""
        self.num_step_failures += 1
        self.num_consecutive_step_failures += 1
        limit = self.config.max_consecutive_step_failures
        if scheduled_ids is None:
            affected = list(self._states.values())
        else:
            owners = (self._sample_owner.get(sid) for sid in scheduled_ids)
            affected = list({o[0].request_id: o[0] for o in owners if o is not None}.values())
        outputs = [self._fail_request(state, STEP_FAILED) for state in affected]
        if self.num_consecutive_step_failures >= limit:
            self.dead_error = EngineDeadError(
                f"the engine is dead after {self.num_consecutive_step_failures} consecutive failed steps "
                f"(max_consecutive_step_failures={limit}); retry on another replica")
            logger.error("%s", self.dead_error)
            raise self.dead_error
        return outputs

    def _forget(self, state: RequestState) -> None:
        self._states.pop(state.request_id, None)
        for sid in state.sample_ids:
            self._sample_owner.pop(sid, None)

    def get_stats(self) -> EngineStats:
        kv = self.kv_cache_manager
        return EngineStats(
            num_requests_running=self.scheduler.num_running, num_requests_waiting=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage, num_free_blocks=kv.num_free_blocks, num_total_blocks=kv.pool.num_blocks - 1,
            prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens,
            num_preemptions=self.scheduler.num_preemptions, prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits, num_swap_outs=self.scheduler.num_swap_outs,
            num_swap_ins=self.scheduler.num_swap_ins, num_swapped_out_blocks=kv.num_swapped_out_blocks,
            num_swapped_in_blocks=kv.num_swapped_in_blocks, num_free_host_blocks=kv.num_free_host_blocks,
            num_total_host_blocks=kv.num_host_blocks)


def _with_num_blocks(config: EngineConfig, num_blocks: int) -> EngineConfig:
    from dataclasses import replace

    return replace(config, cache=replace(config.cache, num_blocks=num_blocks))


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 -- transformers raises many types; name the field instead
        raise InvalidParameter("model", f"cannot load a tokenizer from {model_dir}: {exc}") from exc

"""LLMEngine: requests in, one scheduler + model step at a time, RequestOutputs out. Not thread-safe:
the async server drives it from one thread."""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kvserve.runtime.config import EngineConfig, make_engine_config
from kvserve.runtime.core.kv_cache_manager import KVCacheManager
from kvserve.runtime.core.scheduler import Scheduler
from kvserve.runtime.engine.output_processor import OutputProcessor, RequestState
from kvserve.runtime.outputs import EngineStats, RequestOutput
from kvserve.runtime.request import Request, RequestStatus
from kvserve.runtime.sampling_params import InvalidParameter, SamplingParams

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
                                               num_host_blocks=self.runner.num_host_blocks)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.eos_token_ids = frozenset(config.model.eos_token_ids)
        self._states: dict[str, RequestState] = {}  # public request id -> state
        self._sample_owner: dict[str, tuple[RequestState, int]] = {}  # internal sample id -> (state, index)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._grammar_compiler = None
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
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidParameter("prompt", "a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise InvalidParameter("prompt", f"prompt must be a string, a list of token ids or a dict, "
                                         f"got {type(prompt).__name__}")

    def validate_prompt(self, prompt_token_ids: Sequence[int]) -> None:
        max_len, vocab = self.config.model.max_model_len, self.config.model.vocab_size
        if not prompt_token_ids:
            raise InvalidParameter("prompt", "prompt is empty")
        if len(prompt_token_ids) > max_len:
            raise InvalidParameter("prompt", f"prompt has {len(prompt_token_ids)} tokens, longer than "
                                             f"max_model_len={max_len}")
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidParameter("prompt", f"prompt token ids must be integers in [0, {vocab})")

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
        params = self.compile_constraint(params or SamplingParams())
        if request_id in self._states:
            raise InvalidParameter("request_id", f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        self.validate_prompt(token_ids)
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
        state = self._states.pop(request_id, None)
        if state is None:
            return
        self.scheduler.finish_requests(state.sample_ids, RequestStatus.FINISHED_ABORTED)
        for sid in state.sample_ids:
            self._sample_owner.pop(sid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def check_health(self) -> None:
        """Raise (kvserve.runtime.parallel.errors.WorkerDiedError, naming the rank) if a tensor-parallel
        worker is gone; a no-op in one process. Cheap: the server calls it while idle."""
        check = getattr(self.runner, "check_health", None)
        if check is not None:
            check()

    def shutdown(self) -> None:
        """Release the tensor-parallel worker processes (idempotent; nothing to do in one process)."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    # -- one step ---------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched_out = self.scheduler.schedule()
        now = time.monotonic()
        for scheduled in sched_out.scheduled:
            owner = self._sample_owner.get(scheduled.req_id)
            if owner is not None and owner[0].metrics.first_scheduled_time is None:
                owner[0].metrics.first_scheduled_time = now
        runner_out = self.runner.execute(sched_out)
        core_outputs = self.scheduler.update_from_output(sched_out, runner_out)
        touched: dict[str, RequestState] = {}
        for out in core_outputs:
            owner = self._sample_owner.get(out.req_id)
            if owner is None:
                continue
            state, index = owner
            if index == 0 and not state.samples[0].token_ids:
                self.prompt_tokens += len(state.prompt_token_ids)
            self.generation_tokens += len(out.new_token_ids)
            if self.output_processor.process(state, index, out) is not None:  # hit a stop string
                self.scheduler.finish_requests([out.req_id], RequestStatus.FINISHED_STOPPED)
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            if state.finished:
                state.metrics.finished_time = time.monotonic()
                del self._states[state.request_id]
                for sid in state.sample_ids:
                    self._sample_owner.pop(sid, None)
            outputs.append(state.to_output())
        return outputs

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

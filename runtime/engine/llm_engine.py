"""LLMEngine: the in-process engine. Requests in (text or token ids), one core step at a time, cumulative
RequestOutputs out. Not thread-safe: the async server drives it from one thread.

It is the two halves of the engine in one process: EngineCore (engine_core.py: scheduler, KV manager,
runner, the failure semantics of a step) and RequestTracker (request_tracker.py: detokenisation, stop
strings, outputs). `kvserve serve` runs the same halves in two processes (core_process.py / core_client.py);
the offline `LLM` keeps them here (docs/serving.md has the measurement behind that choice).

Failure semantics (engine/errors.py, enforced by EngineCore): a request the engine cannot serve is refused by
`add_request` (InvalidParameter); a request that fails inside a step fails alone (an output with `error`
set); a step failure fails the requests in that step (retryable); a dead tensor-parallel worker or too many
failed steps in a row make the engine dead (`dead_error`, raised by every later call)."""

from __future__ import annotations

import logging
import time

from kvserve.runtime.config import EngineConfig, make_engine_config
from kvserve.runtime.engine.client import PromptInput
from kvserve.runtime.engine.engine_core import EngineCore
from kvserve.runtime.engine.request_tracker import RequestTracker
from kvserve.runtime.errors import InvalidParameter
from kvserve.runtime.outputs import EngineStats, RequestOutput
from kvserve.runtime.sampling_params import SamplingParams, is_valid_text
from kvserve.runtime.tokenizer import load_tokenizer

logger = logging.getLogger("kvserve.engine")


class LLMEngine:
    """An EngineClient (engine/client.py) with the core in this process."""

    def __init__(self, config: EngineConfig):
        self.tokenizer = load_tokenizer(config.model.model_dir)
        self.core = EngineCore(config, tokenizer_vocab_size=len(self.tokenizer))
        self.config = self.core.config
        self.tracker = RequestTracker(self.tokenizer)
        self._grammar_compiler = None
        m, c = self.config.model, self.config.cache
        logger.info(
            "engine ready: %s, max_model_len=%d, %d KV blocks (+1 reserved null block) x %d tokens (%.1f MiB), "
            "prefix caching %s, chunked prefill %s, attention=%s, device=%s",
            m.architecture,
            m.max_model_len,
            c.num_blocks - 1,
            c.block_size,
            self.executor.kv_cache_bytes / 2**20,
            c.enable_prefix_caching,
            self.config.scheduler.enable_chunked_prefill,
            self.config.attention_backend,
            self.config.device,
        )

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "LLMEngine":
        return cls(make_engine_config(model, **kwargs))

    # The core's parts, for tests and benchmarks that look inside.
    executor = property(lambda self: self.core.executor)
    startup_phases = property(lambda self: self.core.executor.startup_phases)  # (rank 0's with several ranks)
    scheduler = property(lambda self: self.core.scheduler)
    kv_cache_manager = property(lambda self: self.core.kv_cache_manager)
    limits = property(lambda self: self.core.limits)
    eos_token_ids = property(lambda self: self.core.eos_token_ids)
    prompt_tokens = property(lambda self: self.core.prompt_tokens)
    generation_tokens = property(lambda self: self.core.generation_tokens)
    num_step_failures = property(lambda self: self.core.num_step_failures)
    num_consecutive_step_failures = property(lambda self: self.core.num_consecutive_step_failures)
    output_processor = property(lambda self: self.tracker.output_processor)
    _states = property(lambda self: self.tracker.states)

    @property
    def dead_error(self) -> BaseException | None:
        return self.core.dead_error

    @dead_error.setter
    def dead_error(self, value: BaseException | None) -> None:
        self.core.dead_error = value

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
        raise InvalidParameter(
            "prompt", f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}"
        )

    def verify(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidParameter (naming the field) if this engine can never serve the request."""
        self.core.verify(prompt_token_ids, params)

    @property
    def grammar_compiler(self):
        """Compiles structured-output specs for this model (created on first use: xgrammar loads lazily)."""
        if self._grammar_compiler is None:
            from kvserve.runtime.structured_output.compiler import GrammarCompiler

            self._grammar_compiler = GrammarCompiler.for_engine(self.tokenizer, self.config)
        return self._grammar_compiler

    def compile_constraint(self, params: SamplingParams) -> SamplingParams:
        """params with its structured-output grammar compiled (a copy; the same object when there is none)."""
        if params.structured_outputs is None or params.compiled_constraint is not None:
            return params
        from dataclasses import replace

        return replace(params, compiled_constraint=self.grammar_compiler.compile(params.structured_outputs))

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        text, token_ids, params, arrival = self.admit(request_id, prompt, params, arrival_time)
        self.core.verify(token_ids, params)  # the request as a whole (n included), before any child is queued
        parent = self.tracker.add(request_id, text, token_ids, params, arrival)
        try:
            for child in parent.children:  # back to back: the later ones hit the first one's prompt blocks
                self.core.add_request(
                    child.request_id, token_ids, child.params, arrival, count_prompt_tokens=child.counts_prompt_tokens
                )
        except BaseException:
            for child_id in self.tracker.forget(request_id):
                self.core.abort_request(child_id)
            raise

    def admit(
        self, request_id: str, prompt: PromptInput, params: SamplingParams | None, arrival_time: float | None
    ) -> tuple[str | None, list[int], SamplingParams, float]:
        """add_request's front half, shared with CoreClient (the engine core in its own process): refuse when
        dead or on a duplicate id, compile the grammar, tokenise. -> (text, token ids, params, arrival)."""
        if self.dead_error is not None:
            raise self.dead_error
        params = self.compile_constraint(params or SamplingParams())
        if request_id in self.tracker.states:
            raise InvalidParameter("request_id", f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        return text, token_ids, params, time.monotonic() if arrival_time is None else arrival_time

    def abort_request(self, request_id: str) -> None:
        for child_id in self.tracker.forget(request_id):
            self.core.abort_request(child_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.tracker.states)

    def check_health(self) -> None:
        """Raise the engine's fatal error if it is dead (a tensor-parallel worker gone: WorkerDiedError
        naming the rank; too many failed steps: EngineDeadError). Cheap: the server calls it while idle."""
        self.core.check_health()

    def notify(self) -> None:
        """Nothing to wake: step() never waits in this process (EngineClient)."""

    def shutdown(self) -> None:
        """Release the tensor-parallel worker processes (idempotent; nothing to do in one process)."""
        self.core.shutdown()

    # -- one step ---------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        tracked = self.tracker.process(self.core.step())
        if tracked.stopped_ids:
            self.core.finish_stopped(tracked.stopped_ids)
        for request_id in tracked.aborted_ids:
            self.core.abort_request(request_id)
        return tracked.outputs

    def get_stats(self) -> EngineStats:
        return self.core.get_stats()

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
from kvserve.runtime.engine.front import EngineFront
from kvserve.runtime.engine.request_tracker import RequestTracker
from kvserve.runtime.outputs import EngineStats, RequestOutput
from kvserve.runtime.sampling_params import SamplingParams
from kvserve.runtime.tokenizer import load_tokenizer

logger = logging.getLogger("kvserve.engine")


class LLMEngine(EngineFront):
    """An EngineClient (engine/client.py) with the core in this process."""

    def __init__(self, config: EngineConfig):
        self.tokenizer = load_tokenizer(config.model.model_dir)
        self.core = EngineCore(config, tokenizer_vocab_size=len(self.tokenizer))
        self.config = self.core.config
        self.tracker = RequestTracker(self.tokenizer)
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
    sleeping = property(lambda self: bool(self.core.sleep_level))  # --enable-sleep-mode (engine/sleep_control.py)
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
    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        request = self.admit(request_id, prompt, params)  # tokenised, verified (once), grammar compiled
        arrival = time.monotonic() if arrival_time is None else arrival_time
        token_ids = request.prompt_token_ids
        parent = self.tracker.add(request_id, request.prompt, token_ids, request.params, arrival)
        try:
            for child in parent.children:  # back to back: the later ones hit the first one's prompt blocks
                self.core.add_request(
                    child.request_id, token_ids, child.params, arrival, count_prompt_tokens=child.counts_prompt_tokens
                )
        except BaseException:
            for child_id in self.tracker.forget(request_id):
                self.core.abort_request(child_id)
            raise

    def abort_request(self, request_id: str) -> None:
        for child_id in self.tracker.forget(request_id):
            self.core.abort_request(child_id)

    def has_unfinished_requests(self) -> bool:
        # P/D leases and pulls end only in steps (the runner polls NIXL there): the loop keeps stepping.
        return bool(self.tracker.states) or self.core.scheduler.has_kv_transfers

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

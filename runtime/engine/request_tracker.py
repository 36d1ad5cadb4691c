"""The front half of the engine: per-request state on the tokenizer's side of the core boundary.

It turns the core's per-step token-id deltas (EngineCoreOutputs) into cumulative RequestOutputs: incremental
detokenisation, stop strings, logprobs text, n-sample grouping, request timings. The same code serves the
in-process LLMEngine and the API-server process (core_client.CoreClient), so both give identical outputs.

The core learns what the front decided through `TrackedStep`: samples that hit a stop string (finish them as
stopped) and requests whose detokenisation failed (abort them). Across a process boundary the core may have
run one more step for such a sample meanwhile; deltas for samples or requests the front already finished
are dropped here.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from kvserve.runtime.engine.core_messages import EngineCoreOutputs
from kvserve.runtime.errors import RequestError, request_failed
from kvserve.runtime.engine.output_processor import OutputProcessor, RequestState
from kvserve.runtime.outputs import RequestOutput
from kvserve.runtime.sampling_params import SamplingParams

logger = logging.getLogger("kvserve.engine")


@dataclass
class TrackedStep:
    outputs: list[RequestOutput] = field(default_factory=list)
    stopped_sample_ids: list[str] = field(default_factory=list)  # finish these in the core (stop string)
    aborted_request_ids: list[str] = field(default_factory=list)  # the front failed these: abort in the core


class RequestTracker:
    def __init__(self, tokenizer):
        self.output_processor = OutputProcessor(tokenizer)
        self.states: dict[str, RequestState] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            arrival_time: float) -> RequestState:
        state = RequestState(request_id, prompt, prompt_token_ids, params,
                             [f"{request_id}#{i}" for i in range(params.n)], arrival_time)
        self.states[request_id] = state
        return state

    def forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def process(self, core: EngineCoreOutputs) -> TrackedStep:
        step = TrackedStep()
        states = self.states
        for request_id, when in core.first_scheduled:
            state = states.get(request_id)
            if state is not None and state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = when
        failed: dict[str, RequestError] = {f.request_id: RequestError(f.message, f.retryable) for f in core.failures}
        touched: dict[str, RequestState] = {}
        for delta in core.deltas:
            state = states.get(delta.request_id)
            if state is None or delta.request_id in failed:
                continue
            if state.samples[delta.index].finish_reason is not None:  # stopped here, the core ran on meanwhile
                continue
            try:
                if self.output_processor.process(state, delta.index, delta) is not None:  # hit a stop string
                    step.stopped_sample_ids.append(state.sample_ids[delta.index])
            except Exception:  # noqa: BLE001 -- detokenisation / stop checks of this request only
                logger.exception("output processing failed for request %s; failing it alone", state.request_id)
                failed[state.request_id] = request_failed("detokenizing the output or checking stop strings")
                step.aborted_request_ids.append(state.request_id)
                continue
            touched[state.request_id] = state
        for request_id, error in failed.items():
            state = states.get(request_id)
            if state is not None:
                step.outputs.append(self._fail(state, error))
        for state in touched.values():
            if state.request_id in failed:
                continue
            if state.finished:
                state.metrics.finished_time = time.monotonic()
                self.forget(state.request_id)
            step.outputs.append(state.to_output())
        return step

    def _fail(self, state: RequestState, error: RequestError) -> RequestOutput:
        """Report one failed request (finish_reason "error", `error` set); the core has freed or will free it."""
        self.forget(state.request_id)
        for sample in state.samples:
            if sample.finish_reason is None:
                sample.finish_reason = "error"
        state.metrics.finished_time = time.monotonic()
        output = state.to_output()
        output.error = error
        return output

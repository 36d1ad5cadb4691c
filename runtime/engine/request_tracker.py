"""The front half of the engine: per-request state on the tokenizer's side of the core boundary.

It turns the core's per-step token-id deltas (EngineCoreOutputs) into cumulative RequestOutputs: incremental
detokenisation, stop strings, logprobs text, request timings, and the fan-out of n > 1 samples into n child
requests of the core whose outputs merge into one (engine/parent_request.py). The same code serves the
in-process LLMEngine and the API-server process (core_client.CoreClient), so both give identical outputs.

The core learns what the front decided through `TrackedStep`: core requests that hit a stop string (finish
them as stopped) and core requests to abort (the children of a request that failed, here or in the core).
Across a process boundary the core may have run one more step for such a request meanwhile; deltas for
children or requests the front already finished are dropped here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from kvserve.runtime.engine.core_messages import EngineCoreOutputs
from kvserve.runtime.engine.output_processor import OutputProcessor, RequestState
from kvserve.runtime.engine.parent_request import ParentRequest
from kvserve.runtime.errors import RequestError, request_failed
from kvserve.runtime.outputs import RequestOutput
from kvserve.runtime.sampling_params import SamplingParams

logger = logging.getLogger("kvserve.engine")


@dataclass
class TrackedStep:
    outputs: list[RequestOutput] = field(default_factory=list)
    stopped_ids: list[str] = field(default_factory=list)  # core requests to finish as stopped (stop string)
    aborted_ids: list[str] = field(default_factory=list)  # core requests to abort: their request failed


class RequestTracker:
    def __init__(self, tokenizer):
        self.output_processor = OutputProcessor(tokenizer)
        self.states: dict[str, RequestState] = {}  # user request id -> its state
        self._children: dict[str, tuple[RequestState, int]] = {}  # core request id -> (its parent, index)

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> ParentRequest:
        """Track a request; returns its fan-out: the child requests to add to the core, in this order."""
        parent = ParentRequest(request_id, params)
        state = RequestState(request_id, prompt, prompt_token_ids, params, parent.child_ids, arrival_time)
        self.states[request_id] = state
        for child in parent.children:
            self._children[child.request_id] = (state, child.index)
        return parent

    def forget(self, request_id: str) -> list[str]:
        """Stop tracking a request. Returns its children not finished yet (to abort in the core)."""
        state = self.states.pop(request_id, None)
        if state is None:
            return []
        for child_id in state.child_ids:
            self._children.pop(child_id, None)
        return state.unfinished_child_ids()

    def process(self, core: EngineCoreOutputs) -> TrackedStep:
        step = TrackedStep()
        states = self.states
        children = self._children
        for child_id, when in core.first_scheduled:  # the first child scheduled is the request's first
            owner = children.get(child_id)
            if owner is not None and owner[0].metrics.first_scheduled_time is None:
                owner[0].metrics.first_scheduled_time = when
        failed: dict[str, RequestError] = {}  # user request id -> why (one failed child fails its request)
        for failure in core.failures:
            owner = children.get(failure.request_id)
            if owner is not None:
                failed.setdefault(owner[0].request_id, RequestError(failure.message, failure.retryable))
        touched: dict[str, RequestState] = {}
        for delta in core.deltas:
            owner = children.get(delta.request_id)
            if owner is None:
                continue
            state, index = owner
            if state.request_id in failed:
                continue
            if state.samples[index].finish_reason is not None:  # stopped here, the core ran on meanwhile
                continue
            try:
                if self.output_processor.process(state, index, delta) is not None:  # hit a stop string
                    step.stopped_ids.append(delta.request_id)
            except Exception:  # noqa: BLE001 -- detokenisation / stop checks of this request only
                logger.exception("output processing failed for request %s; failing it alone", state.request_id)
                failed[state.request_id] = request_failed("detokenizing the output or checking stop strings")
                continue
            touched[state.request_id] = state
        for request_id, error in failed.items():
            state = states.get(request_id)
            if state is not None:
                step.aborted_ids += state.unfinished_child_ids()  # the failed child too: a no-op in the core
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

"""EngineClient: the one seam between the async front (AsyncEngine, the HTTP server) and an engine.

Three engines implement it: LLMEngine (the core in this process), CoreClient (the core in its own process
over ZMQ) and AttachedCoreClient (one of several API servers sharing a core). AsyncEngine drives whichever it
gets through exactly these members, from its one engine thread (none of them is thread-safe except
`notify`); nothing is probed with getattr. tests/runtime/test_engine_client.py checks that each engine has
every member with the protocol's signature.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Union, runtime_checkable

if TYPE_CHECKING:
    from kvserve.runtime.config import EngineConfig
    from kvserve.runtime.engine.front import PreparedRequest
    from kvserve.runtime.outputs import EngineStats, RequestOutput
    from kvserve.runtime.sampling_params import RequestLimits, SamplingParams

# text, token ids, {"prompt": ..} / {"prompt_token_ids": ..}, or a request the front already verified
PromptInput = Union[str, list[int], dict, "PreparedRequest"]


@runtime_checkable
class EngineClient(Protocol):
    config: EngineConfig  # the engine's validated settings (sized KV cache included)
    limits: RequestLimits  # what a request is validated against at the front
    tokenizer: Any  # the model's transformers tokenizer
    num_step_failures: int  # cumulative failed steps (the engine_step_failures counter)
    startup_phases: dict[str, float]  # seconds per start-up phase of the engine (runtime/startup_phases.py)
    sleeping: bool  # the engine core is asleep (sleep mode), whichever API server put it to sleep

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request, or raise InvalidParameter (naming the field) / the engine's dead error. The
        engine front (engine/front.py) tokenises, verifies and compiles it -- unless it is a PreparedRequest,
        verified already -- and fans n > 1 out."""

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its KV blocks before the next step (unknown ids are ignored)."""

    def step(self) -> list[RequestOutput]:
        """Run (or, across processes, wait for) one step: cumulative outputs of every request that advanced.
        Raises only when the engine is dead."""

    def has_unfinished_requests(self) -> bool: ...

    def get_stats(self) -> EngineStats: ...

    def check_health(self) -> None:
        """Raise the engine's fatal error when it is dead (cheap: called while idle)."""

    def notify(self) -> None:
        """Wake a step() that is waiting for outputs (thread-safe): a request or abort is queued."""

    def shutdown(self) -> None:
        """Release processes and sockets (idempotent)."""

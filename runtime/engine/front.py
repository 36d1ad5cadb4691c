"""The engine front: what happens to a request before the core sees it, once, whichever core is behind.

Tokenise the prompt, verify the request against the core's limits (`verify`: the one call of
sampling_params.verify_request on every path), compile its structured-output grammar, admit it (not dead, an
unused id), then fan n > 1 out into child requests (request_tracker.py) for the core handle: the core in
this process (LLMEngine), in its own process over ZMQ (CoreClient), or shared by several API servers
(AttachedCoreClient). The core trusts what arrives (typed, verified) and checks only what only it knows:
a duplicate id among its live requests, n == 1, and whether a LoRA adapter is served at that moment.

A caller that verifies up front -- the API server (to answer 400 naming the request's own field before any
work) and the offline LLM (every prompt of a batch before the first is queued) -- hands `add_request` a
PreparedRequest, which the front queues as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kvserve.runtime import sampling_params
from kvserve.runtime.errors import InvalidParameter
from kvserve.runtime.sampling_params import RequestLimits, SamplingParams, is_valid_text


@dataclass(frozen=True)
class PreparedRequest:
    """A request the front tokenised and verified (`EngineFront.prepare`, or `verify` by the server), with
    its grammar compiled when it has one."""

    prompt: str | None  # the text, when the prompt was text (outputs report it)
    prompt_token_ids: list[int]
    params: SamplingParams


def verify(
    prompt_token_ids: list[int], params: SamplingParams, limits: RequestLimits, prompt_param: str = "prompt"
) -> None:
    """InvalidParameter (naming the field) if the engine can never serve the request: the front's one check."""
    if not isinstance(params, SamplingParams):
        raise InvalidParameter(
            "sampling_params", f"sampling_params must be a SamplingParams, got {type(params).__name__}"
        )
    sampling_params.verify_request(prompt_token_ids, params, limits, prompt_param)


class EngineFront:
    """The front half LLMEngine and CoreClient share. Needs tokenizer, limits, config, tracker, dead_error."""

    tokenizer: Any
    limits: RequestLimits
    _grammar_compiler: Any = None

    def tokenize_prompt(self, prompt: Any) -> tuple[str | None, list[int]]:
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
        return replace(params, compiled_constraint=self.grammar_compiler.compile(params.structured_outputs))

    def prepare(self, prompt: Any, params: SamplingParams | None = None) -> PreparedRequest:
        """Tokenise, verify, compile: InvalidParameter naming the field when the request cannot be served."""
        params = SamplingParams() if params is None else params
        text, token_ids = self.tokenize_prompt(prompt)
        verify(token_ids, params, self.limits)
        return PreparedRequest(text, token_ids, self.compile_constraint(params))

    def admit(self, request_id: str, prompt: Any, params: SamplingParams | None) -> PreparedRequest:
        """add_request's front half: refuse when dead or on a duplicate id, then prepare (unless prepared)."""
        if self.dead_error is not None:
            raise self.dead_error
        if request_id in self.tracker.states:
            raise InvalidParameter("request_id", f"request id {request_id!r} is already in use")
        if isinstance(prompt, PreparedRequest):
            if params is not None and params is not prompt.params:
                raise InvalidParameter("sampling_params", "a PreparedRequest carries its own sampling params")
            return prompt
        return self.prepare(prompt, params)

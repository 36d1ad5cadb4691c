"""Per-request sampling parameters, validated once when the request enters the engine."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Temperatures below this are treated as greedy: dividing logits by ~0 overflows.
_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 disables
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (the sampled one is always added)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Grammar-constrained output (kvserve.runtime.structured_output.StructuredOutputSpec), and the compiled
    # grammar the edge attaches before the request reaches the engine (LLM.generate / the HTTP handler).
    structured_outputs: Any = None
    compiled_constraint: Any = field(default=None, compare=False, repr=False)
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"n must be an integer >= 1, got {self.n!r}")
        _check(self.temperature >= 0, "temperature", f"temperature must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check(isinstance(self.top_k, int) and (self.top_k in (-1, 0) or self.top_k >= 1), "top_k",
               f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        _check(0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1), "max_tokens",
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
               f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20), "logprobs",
               f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty",
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty",
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(0 < self.repetition_penalty <= 2, "repetition_penalty",
               f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        _check(all(isinstance(s, str) and s for s in self.stop_strings), "stop", "stop must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "stop_token_ids must be non-negative integers")
        if self.structured_outputs is not None:
            from kvserve.runtime.structured_output.spec import StructuredOutputSpec

            _check(isinstance(self.structured_outputs, StructuredOutputSpec), "structured_outputs",
                   "structured_outputs must be a StructuredOutputSpec (see StructuredOutputSpec.from_request)")
            # The grammar ends the output with EOS once complete; ignoring EOS would run past the grammar.
            _check(not self.ignore_eos, "ignore_eos", "ignore_eos cannot be combined with structured outputs")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def for_sample(self, index: int) -> "SamplingParams":
        """The params of the index-th of n parallel samples: n=1 and a distinct seed (vLLM: seed + i)."""
        from dataclasses import replace

        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)


class InvalidParameter(ValueError):
    """A request parameter is invalid. `param` names the field (OpenAI error bodies carry it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParameter(param, message)

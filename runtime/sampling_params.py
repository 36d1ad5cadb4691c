"""Per-request sampling parameters and the one validator of a request against the model serving it.

Two layers, shared by the HTTP server and the offline `LLM`: `SamplingParams.__post_init__` checks what
needs no model (types, ranges, list lengths); `verify_request(prompt_token_ids, params, limits)` checks what
depends on the engine (`RequestLimits`: vocabulary, context length, batch size, KV pool). Both raise
`InvalidParameter` naming the field, so every request the engine cannot serve is refused before it reaches
the engine -- never queued for ever, never failing inside a step next to other clients' requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvserve.runtime.errors import InvalidParameter

# Temperatures below this are treated as greedy: dividing logits by ~0 overflows.
_GREEDY_EPS = 1e-5

# Bounds of request fields (the HTTP protocol models use the same constants).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # torch.Generator.manual_seed takes a 64-bit seed
MAX_N = 64  # samples per prompt
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024  # every step searches the text tail for every stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_PROMPTS = 64  # prompts in one completions request / entries of one batch field


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
    # --enable-lora: the adapter (a --lora-modules name) this request runs with; None: the base model.
    lora_name: str | None = None
    # P/D disaggregation (vLLM's kv_transfer_params, docs/disaggregation.md): {"do_remote_decode": true} on a
    # prefill engine; the prefill's returned params ({"do_remote_prefill": true, remote_*}) on a decode engine.
    kv_transfer_params: dict | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check(
            self.stop is None or isinstance(self.stop, (str, list, tuple)),
            "stop",
            "stop must be a string or a list of strings",
        )
        _check(
            self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)),
            "stop_token_ids",
            "stop_token_ids must be a list of token ids",
        )
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        _check(
            _is_number(self.temperature) and self.temperature >= 0,
            "temperature",
            f"temperature must be a finite number >= 0, got {self.temperature!r}",
        )
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(
            _is_int(self.top_k) and (self.top_k in (-1, 0) or self.top_k >= 1),
            "top_k",
            f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}",
        )
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(
            self.seed is None or (_is_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX - (self.n - 1)),
            "seed",
            f"seed must be an integer in [{INT64_MIN}, {INT64_MAX}] (with n={self.n} samples, seed + "
            f"{self.n - 1} too), got {self.seed!r}",
        )
        _check(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        _check(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            "min_tokens",
            f"min_tokens must be an integer >= 0, got {self.min_tokens!r}",
        )
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
        )
        _check(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
        )
        _check(
            _is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}",
        )
        _check(
            _is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}",
        )
        _check(
            _is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= 2,
            "repetition_penalty",
            f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}",
        )
        _check(len(self.stop_strings) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings")
        _check(
            all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop_strings),
            "stop",
            f"stop must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters",
        )
        _check(
            all(is_valid_text(s) for s in self.stop_strings),
            "stop",
            "stop strings must be valid Unicode text (no lone surrogates)",
        )
        _check(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids",
        )
        _check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "stop_token_ids must be non-negative integers",
        )
        if self.structured_outputs is not None:
            from kvserve.runtime.structured_output.spec import StructuredOutputSpec

            _check(
                isinstance(self.structured_outputs, StructuredOutputSpec),
                "structured_outputs",
                "structured_outputs must be a StructuredOutputSpec (see StructuredOutputSpec.from_request)",
            )
            # The grammar ends the output with EOS once complete; ignoring EOS would run past the grammar.
            _check(not self.ignore_eos, "ignore_eos", "ignore_eos cannot be combined with structured outputs")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _check(isinstance(getattr(self, name), bool), name, f"{name} must be true or false")
        if self.kv_transfer_params is not None:
            _check_kv_transfer_params(self.kv_transfer_params)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def for_sample(self, index: int) -> "SamplingParams":
        """The params of the index-th of n parallel samples: n=1 and a distinct seed (vLLM: seed + i)."""
        from dataclasses import replace

        # P/D: only the first sample pulls (or, on a prefill engine, leases) the prompt's KV; the others take
        # it as a prefix-cache hit or compute it, so one lease is never read twice.
        kv = self.kv_transfer_params if index == 0 else None
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index, kv_transfer_params=kv)


def _check_kv_transfer_params(params: Any) -> None:
    name = "kv_transfer_params"
    _check(isinstance(params, dict), name, f"{name} must be an object, got {type(params).__name__}")
    for flag in ("do_remote_decode", "do_remote_prefill"):
        _check(params.get(flag) in (None, True, False), f"{name}.{flag}", f"{name}.{flag} must be true or false")
    _check(
        not (params.get("do_remote_decode") and params.get("do_remote_prefill")),
        name,
        f"{name}: do_remote_decode and do_remote_prefill cannot both be true",
    )
    if not params.get("do_remote_prefill"):
        return
    ids = params.get("remote_block_ids")
    _check(
        isinstance(ids, list) and all(_is_int(b) and b >= 0 for b in ids),
        f"{name}.remote_block_ids",
        f"{name}.remote_block_ids must be a list of block ids with do_remote_prefill, got {ids!r}",
    )
    for key in ("remote_engine_id", "remote_host", "remote_request_id"):
        value = params.get(key)
        _check(
            isinstance(value, str) and bool(value),
            f"{name}.{key}",
            f"{name}.{key} must be a non-empty string with do_remote_prefill, got {value!r}",
        )
    port = params.get("remote_port")
    _check(
        _is_int(port) and 1 <= port <= 65535,
        f"{name}.remote_port",
        f"{name}.remote_port must be a port in [1, 65535] with do_remote_prefill, got {port!r}",
    )


@dataclass(frozen=True)
class RequestLimits:
    """What an engine can serve (from its config once the KV pool is sized); plain data, picklable."""

    vocab_size: int  # token ids must be below this (the smaller of the model's and the tokenizer's)
    max_model_len: int
    max_num_seqs: int
    block_size: int
    num_usable_blocks: int  # KV blocks requests can hold (the null block excluded)


def verify_request(
    prompt_token_ids: list[int], params: SamplingParams, limits: RequestLimits, prompt_param: str = "prompt"
) -> None:
    """Refuse (InvalidParameter naming the field) a request this engine can never serve: token ids outside
    the vocabulary, a context longer than max_model_len, more samples than can run at once (n > max_num_seqs:
    the n child requests of one prompt could never all run together, so the later ones would wait for the
    earlier ones to finish), or a sequence that cannot fit the KV pool even alone."""
    vocab, max_len = limits.vocab_size, limits.max_model_len
    if not prompt_token_ids:
        raise InvalidParameter(prompt_param, f"{prompt_param} is empty")
    if len(prompt_token_ids) > max_len:
        raise InvalidParameter(
            prompt_param, f"{prompt_param} has {len(prompt_token_ids)} tokens, longer than max_model_len={max_len}"
        )
    if not all(_is_int(t) and 0 <= t < vocab for t in prompt_token_ids):
        raise InvalidParameter(prompt_param, f"{prompt_param} token ids must be integers in [0, {vocab})")
    bad_stops = [t for t in params.stop_token_ids if t >= vocab]
    if bad_stops:
        raise InvalidParameter(
            "stop_token_ids", f"stop_token_ids must be below the vocabulary size {vocab}, got {bad_stops[:5]}"
        )
    if params.n > limits.max_num_seqs:
        raise InvalidParameter(
            "n",
            f"n={params.n} samples cannot run together: this server runs at most "
            f"max_num_seqs={limits.max_num_seqs} sequences at once",
        )
    prompt_len = len(prompt_token_ids)
    max_tokens = max_len - prompt_len if params.max_tokens is None else params.max_tokens
    if prompt_len + max_tokens > max_len:
        raise InvalidParameter(
            "max_tokens",
            (
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion). "
                "Please reduce the length of the prompt or max_tokens."
            ),
        )
    if params.min_tokens > max_len - prompt_len:
        raise InvalidParameter(
            "min_tokens",
            f"min_tokens={params.min_tokens} cannot be reached within "
            f"max_model_len={max_len} after a {prompt_len}-token prompt",
        )
    blocks_needed = -(-(prompt_len + max_tokens) // limits.block_size)
    if blocks_needed > limits.num_usable_blocks:
        raise InvalidParameter(
            "max_tokens",
            f"prompt plus max_tokens ({prompt_len + max_tokens} tokens) needs "
            f"{blocks_needed} KV blocks; the KV pool has {limits.num_usable_blocks}",
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_valid_text(text: str) -> bool:
    """False for text holding lone surrogates (JSON can carry "\\ud800"; tokenizers cannot encode it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParameter(param, message)

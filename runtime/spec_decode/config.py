"""--speculative-config: vLLM's JSON, parsed and checked once. Pure Python (the operator and the scheduler
side import it without torch).

Methods: "ngram" (prompt lookup: the longest suffix of the request's own tokens seen before proposes what
followed it) and "suffix" (suffix decoding: a suffix tree over the request's tokens and recent requests'
outputs proposes the most frequent continuation, as many tokens as the match supports). Both propose from
tokens alone, so no draft model, no extra KV and no lookahead slots.

Load switch: above `disable_by_batch_size` running requests no request gets proposals (the verify work
then competes with the batch instead of filling idle compute); vLLM V0 had the option, V1 dropped it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from kvserve.runtime.errors import InvalidParameter

METHODS = ("ngram", "suffix")
# vLLM's own cap on proposals per step (rejection_sampler.MAX_SPEC_LEN).
MAX_SPECULATIVE_TOKENS = 128
# Running requests above which proposals stop, when the JSON does not say: measured on this 2-core CPU
# (docs/performance.md, "Speculative decoding"), where a step's cost grows with its tokens from a few
# streams on.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    # suffix decoding (Arctic Inference's names and defaults)
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1


def _int(config: dict, key: str, default: int, minimum: int) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidParameter(
            "speculative_config", f"speculative_config.{key} must be an integer >= {minimum}, got {value!r}"
        )
    return value


def _float(config: dict, key: str, default: float, low: float, high: float | None = None) -> float:
    value = config.get(key, default)
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or value < low
        or (high is not None and value > high)
    ):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidParameter(
            "speculative_config", f"speculative_config.{key} must be a number {bound}, got {value!r}"
        )
    return float(value)


def parse_speculative_config(value: str | dict | None) -> SpeculativeConfig | None:
    """The --speculative-config JSON (or LLM(speculative_config={...})) -> SpeculativeConfig; None when unset.
    Errors are InvalidParameter naming `speculative_config` and the key."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidParameter("speculative_config", f"speculative_config is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidParameter("speculative_config", f"speculative_config must be a JSON object, got {value!r}")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidParameter(
            "speculative_config",
            f"speculative_config has unknown key(s) {', '.join(unknown)} "
            f"(kvserve supports: {', '.join(sorted(known))})",
        )
    method = value.get("method")
    if method not in METHODS:
        hint = " (draft models and EAGLE are not supported yet)" if method in ("draft_model", "eagle", "eagle3") else ""
        raise InvalidParameter(
            "speculative_config", f"speculative_config.method must be one of {', '.join(METHODS)}, got {method!r}{hint}"
        )
    if method == "ngram":
        # vLLM: both 5 when neither is set; one set is copied to the other.
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        lo, hi = (lo if lo is not None else hi), (hi if hi is not None else lo)
        value = {**value, "prompt_lookup_min": 5 if lo is None else lo, "prompt_lookup_max": 5 if hi is None else hi}
    depth = _int(value, "suffix_decoding_max_tree_depth", 24, 1)
    # Suffix decoding's count is a maximum and defaults to the tree depth; n-gram needs it given.
    default_k: Any = depth if method == "suffix" else None
    if method == "ngram" and "num_speculative_tokens" not in value:
        raise InvalidParameter("speculative_config", "speculative_config.num_speculative_tokens is required for ngram")
    k = _int(value, "num_speculative_tokens", default_k, 1)
    if k > MAX_SPECULATIVE_TOKENS:
        raise InvalidParameter(
            "speculative_config",
            f"speculative_config.num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, got {k}",
        )
    lookup_min = _int(value, "prompt_lookup_min", 5, 1)
    lookup_max = _int(value, "prompt_lookup_max", 5, 1)
    if lookup_min > lookup_max:
        raise InvalidParameter(
            "speculative_config",
            f"speculative_config.prompt_lookup_min ({lookup_min}) must be <= prompt_lookup_max ({lookup_max})",
        )
    return SpeculativeConfig(
        method=method,
        num_speculative_tokens=k,
        prompt_lookup_min=lookup_min,
        prompt_lookup_max=lookup_max,
        disable_by_batch_size=_int(value, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE, 1),
        suffix_decoding_max_tree_depth=depth,
        suffix_decoding_max_cached_requests=_int(value, "suffix_decoding_max_cached_requests", 10000, 0),
        suffix_decoding_max_spec_factor=_float(value, "suffix_decoding_max_spec_factor", 1.0, 0.0),
        suffix_decoding_min_token_prob=_float(value, "suffix_decoding_min_token_prob", 0.1, 0.0, 1.0),
    )

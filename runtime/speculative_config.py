"""--speculative-config: vLLM's JSON, parsed and checked once. Pure Python (the operator and the scheduler
side import it without torch).

Methods: "ngram" (prompt lookup: the longest suffix of the request's own tokens seen before proposes what
followed it) and "suffix" (suffix decoding: a suffix tree over the request's tokens and recent requests'
outputs proposes the most frequent continuation, as many tokens as the match supports). Both propose from
tokens alone, so no draft model, no extra KV and no lookahead slots.

"draft_model" (vLLM's keys: "model" = a local directory of a smaller model with the target's vocabulary,
"num_speculative_tokens"): the draft runs k greedy (or, for sampled requests, sampled) steps in the engine core
process on its own paged KV cache (executor/draft_model.py); TP=1 whatever the target's TP (vLLM's
draft_tensor_parallel_size 1). "draft_kv_cache_bytes" (kvserve's key) sizes that cache; by default it holds as
many blocks as the target's.

Load switch: above `disable_by_batch_size` running requests no request gets proposals (the verify work
then competes with the batch instead of filling idle compute); vLLM V0 had the option, V1 dropped it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any

from kvserve.runtime.errors import InvalidParameter

METHODS = ("ngram", "suffix", "draft_model")
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
    # draft_model: the draft's local directory, its TP (1 only) and its KV budget (None: the target's block count)
    model: str | None = None
    draft_tensor_parallel_size: int = 1
    draft_kv_cache_bytes: int | None = None


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
    if method is None and value.get("model") is not None:  # vLLM: a model without a method is a draft model
        method = "draft_model"
    if method not in METHODS:
        hint = " (EAGLE is not supported yet)" if method in ("eagle", "eagle3") else ""
        raise InvalidParameter(
            "speculative_config", f"speculative_config.method must be one of {', '.join(METHODS)}, got {method!r}{hint}"
        )
    if method == "ngram":
        # vLLM: both 5 when neither is set; one set is copied to the other.
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        lo, hi = (lo if lo is not None else hi), (hi if hi is not None else lo)
        value = {**value, "prompt_lookup_min": 5 if lo is None else lo, "prompt_lookup_max": 5 if hi is None else hi}
    model = _draft_model_dir(value, method)
    depth = _int(value, "suffix_decoding_max_tree_depth", 24, 1)
    # Suffix decoding's count is a maximum and defaults to the tree depth; n-gram needs it given.
    default_k: Any = depth if method == "suffix" else None
    if method in ("ngram", "draft_model") and "num_speculative_tokens" not in value:
        raise InvalidParameter(
            "speculative_config", f"speculative_config.num_speculative_tokens is required for {method}"
        )
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
        model=model,
        draft_tensor_parallel_size=_draft_tp(value),
        draft_kv_cache_bytes=None
        if value.get("draft_kv_cache_bytes") is None
        else _int(value, "draft_kv_cache_bytes", None, 1),
    )


def _draft_model_dir(config: dict, method: str) -> str | None:
    """draft_model: `model` must be a local model directory (config.json); other methods take no model."""
    model = config.get("model")
    if method != "draft_model":
        if model is not None:
            raise InvalidParameter(
                "speculative_config", f"speculative_config.model is only used by method draft_model, not {method}"
            )
        return None
    if not isinstance(model, str) or not model:
        raise InvalidParameter(
            "speculative_config", "speculative_config.model (the draft model's local directory) is required"
        )
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise InvalidParameter(
            "speculative_config",
            f"speculative_config.model {model!r} is not a local model directory (no config.json there)",
        )
    return model


def _draft_tp(config: dict) -> int:
    tp = config.get("draft_tensor_parallel_size", 1)
    if tp != 1:
        raise InvalidParameter(
            "speculative_config",
            f"speculative_config.draft_tensor_parallel_size must be 1 (the draft runs in the engine core "
            f"process, unsharded), got {tp!r}",
        )
    return 1


def draft_vocab_size(model_dir: str) -> int | None:
    """The draft's vocab_size from its config.json (multimodal configs keep it under text_config)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    return config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))


def check_draft_vocab(config: SpeculativeConfig, target_vocab_size: int) -> None:
    """Drafts are target token ids and q is compared with p entry by entry: the vocabularies must be one."""
    vocab = draft_vocab_size(config.model)
    if vocab != target_vocab_size:
        raise InvalidParameter(
            "speculative_config",
            f"speculative_config.model {config.model!r} has vocab_size {vocab}, the target model has "
            f"{target_vocab_size}: a draft model must share the target's tokenizer and vocabulary",
        )

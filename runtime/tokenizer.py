"""Tokenizers, in one place: loading a model dir's tokenizer (transformers'), the chat template a model
without one gets, and detokenisation (a fast exact decode, and vLLM's incremental scheme for streaming).
The engine, the API server and the router all go through here, so they see the same tokens and text."""

from __future__ import annotations

import json
import os
import time

from kvserve.runtime.errors import InvalidParameter

# Used when the model ships no chat template (base models such as stories260K): role-prefixed turns.
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token if bos_token else '' }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% else %}{{ message['role'] | capitalize }}: {{ message['content'] + '\n\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

CONTEXT_TOKENS = 5  # as vLLM's initial incremental-detokenisation offset


_FIRST_LOAD_S: list[float] = []  # this process's first load, transformers' imports included (one entry)


def load_tokenizer(model_dir: str):
    """The model directory's tokenizer: the object transformers' AutoTokenizer gives (its class chosen by
    AutoTokenizer's rules; tokenizers_backend_class takes the short way to the same class where it can)."""
    started = time.monotonic()
    try:
        backend = tokenizers_backend_class(model_dir)
        if backend is not None:
            tokenizer = backend.from_pretrained(model_dir, local_files_only=True, _from_auto=True)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 -- transformers raises many types; name the field instead
        raise InvalidParameter("model", f"cannot load a tokenizer from {model_dir}: {exc}") from exc
    if not _FIRST_LOAD_S:
        _FIRST_LOAD_S.append(time.monotonic() - started)
    return tokenizer


def tokenizers_backend_class(model_dir: str):
    """transformers' TokenizersBackend (the tokenizer.json-backed class) where AutoTokenizer is sure to choose it
    for this directory, decided from the files; else None (then AutoTokenizer decides).

    AutoTokenizer loads the model's AutoConfig only to pick the class, and importing a model's config class
    costs more than the tokenizer (transformers' type_validators -> hub_kernels -> torch.distributed.tensor,
    sympy, accelerate): on a warm `kvserve serve` that was the API server's longest step before the engine core
    got its config (issue 43). Followed from transformers 5's AutoTokenizer.from_pretrained, for a directory
    without remote code (auto_map) whose model type is not on its list of checkpoints with a wrong tokenizer
    class: no declared class and no tokenizer registered for the model type -> TokenizersBackend; a declared
    class and none registered -> the declared class by name ("Fast" dropped; PythonBackend or unknown ->
    TokenizersBackend: the demo model's PreTrainedTokenizerFast); TokenizersBackend declared (what `kvserve
    serve MODEL.gguf` writes) -> TokenizersBackend unless the registered one is MistralCommonBackend. Only a
    TokenizersBackend outcome takes the short way; anything else, or a transformers without TokenizersBackend,
    takes AutoTokenizer's own path. tests/runtime/test_tokenizer_load.py checks it against AutoTokenizer."""
    config = _json_file(model_dir, "config.json")
    tokenizer_config = _json_file(model_dir, "tokenizer_config.json") or {}
    if config is None or not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        return None
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or any(k in config for k in ("auto_map", "tokenizer_class", "model_name")):
        return None
    declared = tokenizer_config.get("tokenizer_class")
    if "auto_map" in tokenizer_config or not (declared is None or isinstance(declared, str)):
        return None
    try:
        from transformers.models.auto.tokenization_auto import (
            MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
            TOKENIZER_MAPPING_NAMES,
            tokenizer_class_from_name,
        )
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # transformers 4: no TokenizersBackend, AutoTokenizer's rules differ
        return None
    if model_type in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS:
        return None
    registered = TOKENIZER_MAPPING_NAMES.get(model_type)
    if declared is None:
        chosen = TokenizersBackend if registered in (None, "TokenizersBackend") else None
    elif registered is None:
        name = declared.removesuffix("Fast")
        if name == "LlamaTokenizer":
            return None  # AutoTokenizer looks into tokenizer.json for this one
        chosen = tokenizer_class_from_name(name) or tokenizer_class_from_name(name + "Fast")
        if chosen is None or chosen.__name__ == "PythonBackend":
            chosen = TokenizersBackend
    elif declared == "TokenizersBackend" and registered.removesuffix("Fast") != "MistralCommonBackend":
        chosen = TokenizersBackend
    else:
        chosen = None
    return TokenizersBackend if chosen is TokenizersBackend else None


def _json_file(model_dir: str, name: str) -> dict | None:
    path = os.path.join(model_dir, name)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        data = json.load(f)
    return data if isinstance(data, dict) else None


def first_load_seconds() -> float | None:
    """Seconds this process's first load_tokenizer took, importing transformers included (the API server's
    `tokenizer_load` start-up phase); None before one succeeded."""
    return _FIRST_LOAD_S[0] if _FIRST_LOAD_S else None


def chat_template(tokenizer) -> str:
    """The model's own chat template, else FALLBACK_CHAT_TEMPLATE."""
    return getattr(tokenizer, "chat_template", None) or FALLBACK_CHAT_TEMPLATE


def fast_decode(tokenizer):
    """`decode(ids, skip_special_tokens)` giving exactly `tokenizer.decode(ids, skip_special_tokens=...)`.

    Incremental detokenisation decodes two short windows per token per sample; through transformers'
    `decode` (list conversion, kwargs plumbing, the clean-up option) a 5-token window costs ~4.4 us against
    ~1.4 us in the Rust tokenizer it ends in (measured on the demo tokenizer). When the tokenizer is a plain
    tokenizers-backed one whose decode is exactly `backend.decode` (no clean-up of tokenization spaces, no
    subclass overriding decode/_decode), call the backend directly; otherwise keep transformers' path."""

    def slow(ids: list[int], skip_special_tokens: bool) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: stay on the general path
        return slow
    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        backend is None
        or not isinstance(tokenizer, TokenizersBackend)
        or cls.decode is not PreTrainedTokenizerBase.decode
        or cls._decode is not TokenizersBackend._decode
        or getattr(tokenizer, "clean_up_tokenization_spaces", True)
    ):
        return slow
    backend_decode = backend.decode

    def fast(ids: list[int], skip_special_tokens: bool) -> str:
        return backend_decode(ids, skip_special_tokens=skip_special_tokens)

    return fast


def detokenize_incremental(decode_ids, sample, skip_special_tokens: bool, final: bool) -> str:
    """Text of all of `sample`'s tokens (`decode_ids` from fast_decode; `sample` carries token_ids and the
    offsets below, updated in place), decoding only a small window per step (a full decode every
    step is quadratic in the output length). Windows holding bytes that are not (yet) valid UTF-8 fall
    back to a full decode, so the result is always exactly what decoding all tokens gives."""
    ids = sample.token_ids

    def decode(part: list[int]) -> str:
        return decode_ids(part, skip_special_tokens)

    prefix = decode(ids[sample.prefix_offset : sample.read_offset])
    window = decode(ids[sample.prefix_offset :])
    if "\ufffd" in window or not window.startswith(prefix):
        text = decode(ids)
        if final or not text.endswith("\ufffd"):
            # Resync; keep a few tokens of context so word-boundary spaces decode as in the full text.
            sample.decoded_text = text
            sample.read_offset = len(ids)
            sample.prefix_offset = max(0, len(ids) - CONTEXT_TOKENS)
        return text
    if len(window) > len(prefix):
        sample.decoded_text += window[len(prefix) :]
        sample.prefix_offset, sample.read_offset = sample.read_offset, len(ids)
    return sample.decoded_text

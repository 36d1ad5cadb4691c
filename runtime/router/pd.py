"""Disaggregated prefill/decode (P/D) in the router, the pure part: replica roles, the per-request decision
(prefill remotely or not), the two legs' request bodies and the usage rewrite. No I/O; proxy.py runs the legs.

The wire protocol is vLLM's `kv_transfer_params` (NixlConnector and the connectors that copy it), as its toy
proxy (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py) and llm-d's pd-sidecar speak it:
- P leg: the client's body with `kv_transfer_params = {do_remote_decode: true, do_remote_prefill: false,
  remote_engine_id/remote_block_ids/remote_host/remote_port: null}`, `stream: false`, `max_tokens: 1` (and
  `max_completion_tokens: 1` when the body has it), `stream_options` removed, `min_tokens` removed. The prefill
  engine answers a normal completion whose `kv_transfer_params` say where its blocks are.
- D leg: the client's body, unchanged but for `kv_transfer_params` = exactly what P returned (streamed back to
  the client when it asked for a stream).
Both legs carry one fresh `X-Request-Id`, as the toy proxy's do.

Roles are llm-d's `llm-d.ai/role` values: `prefill`, `decode`, `prefill-decode` (its older spelling `both`).
A replica without a role serves both. A prefill replica takes only P legs; decode and both take D legs and
aggregated requests (a request prefilled where it decodes).

The default decision is Dynamo's disaggregated router rule (examples/llm/components/disagg_router.py; the
Rust DisaggregatedRouter's `prefill_length - prefix_hit_length > max_local_prefill_length`): prefill remotely
only when the uncached part of the prompt (prompt tokens minus the decode replica's cached prefix, from the
router's prefix or KV-event index) is longer than `max_local_prefill_length` (1000) tokens and the best prefill
replica has fewer than `max_prefill_queue` (2) requests waiting; otherwise prefill on the decode replica.
Optionally (`remote_prefill_min_uncached_ratio`, off by default) also locally when the uncached part is under
that fraction of the prompt. Dynamo's newer conditional disaggregation (lib/kv-router conditional_disagg.rs)
bypasses to local only when the uncached part is both under 2048 tokens and under 70% of the prompt, so a
short fresh prompt goes remote there; issue 42 asks for short prompts to stay local, which the older rule does.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

PREFILL, DECODE, BOTH = "prefill", "decode", "both"
# llm-d.ai/role values -> the router's roles; anything else (e.g. "encode") takes no request from the router.
ROLE_LABEL_VALUES = {"prefill": PREFILL, "decode": DECODE, "prefill-decode": BOTH, "both": BOTH}
DECIDERS = ("conditional", "always", "never")
PREFILL_CANDIDATES = frozenset({PREFILL, BOTH})
DECODE_CANDIDATES = frozenset({DECODE, BOTH})

# Request paths: remote_prefill (P then D), local (D alone, by decision), fallback (D alone after P failed).
REMOTE, LOCAL, FALLBACK = "remote_prefill", "local", "fallback"


def role_from_label(value: str | None) -> str | None:
    """A pod's llm-d.ai/role label -> its role; no label: both; an unknown value: None (not routed to)."""
    if value is None or value == "":
        return BOTH
    return ROLE_LABEL_VALUES.get(value.strip().lower())


def check_decider(name: str) -> str:
    if name not in DECIDERS:
        raise ValueError(f"pd_decider must be one of {', '.join(DECIDERS)}, got {name!r}")
    return name


@dataclass(frozen=True)
class PDRule:
    decider: str
    max_local_prefill_length: int  # tokens: an uncached part no longer than this is prefilled locally
    max_prefill_queue: int  # requests waiting on the best prefill replica at which the pool counts as saturated
    remote_prefill_min_uncached_ratio: float  # uncached / prompt below this: prefilled locally (0: off)

    def __post_init__(self) -> None:
        check_decider(self.decider)
        if self.max_local_prefill_length < 0:
            raise ValueError(f"max_local_prefill_length must be >= 0, got {self.max_local_prefill_length}")
        if not 0.0 <= self.remote_prefill_min_uncached_ratio <= 1.0:
            raise ValueError(
                f"remote_prefill_min_uncached_ratio must be in [0, 1], got {self.remote_prefill_min_uncached_ratio}"
            )
        if self.max_prefill_queue < 1:
            raise ValueError(f"max_prefill_queue must be >= 1, got {self.max_prefill_queue}")

    def by_length(self, prompt_tokens: int, uncached_tokens: int) -> tuple[bool, str]:
        """(prefill remotely?, reason) from the prompt alone; the pool's saturation is `by_queue`'s."""
        if self.decider == "never":
            return False, "disabled"
        if self.decider == "always":
            return True, "always"
        if prompt_tokens <= self.max_local_prefill_length:
            return False, "short"
        if uncached_tokens <= self.max_local_prefill_length:
            return False, "cached"  # long, but the decode replica holds all but a short tail
        if uncached_tokens < self.remote_prefill_min_uncached_ratio * prompt_tokens:
            return False, "cached"
        return True, "long_uncached"

    def by_queue(self, prefill_queue: int) -> tuple[bool, str]:
        if self.decider == "conditional" and prefill_queue >= self.max_prefill_queue:
            return False, "prefill_saturated"
        return True, "ok"


def prefill_queue(waiting: int | None, in_flight: int) -> int:
    """Requests waiting on a prefill replica: its own `vllm:num_requests_waiting` from a fresh scrape; without
    one, the router's legs in flight there beyond the one it is working on (a guess that errs towards local)."""
    return waiting if waiting is not None else max(0, in_flight - 1)


def estimate_prompt_tokens(path: str, body: Any) -> int:
    """Prompt length without a tokenizer: characters / 4 (llm-d's prefix-based-pd-decider estimate), token ids
    counted as they are. 0 when the body has no recognisable prompt."""
    if not isinstance(body, dict):
        return 0
    if path.endswith("/chat/completions"):
        chars = 0
        for m in body.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
        return chars // 4
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: the first prompt, as the router's tokenizer reads it
    if isinstance(prompt, str):
        return len(prompt) // 4
    if isinstance(prompt, list):
        return len(prompt)
    return 0


# ---- the legs' bodies --------------------------------------------------------------------------------------
def prefill_body(payload: dict) -> dict:
    """The P leg's body (vLLM toy proxy's send_request_to_service)."""
    body = copy.deepcopy(payload)
    body["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body.pop("stream_options", None)
    body.pop("min_tokens", None)
    return body


def decode_body(payload: dict, kv_transfer_params: dict) -> dict:
    """The D leg's body: the client's, plus the prefill engine's kv_transfer_params."""
    body = dict(payload)
    body["kv_transfer_params"] = kv_transfer_params
    return body


@dataclass(frozen=True)
class PrefillAnswer:
    kv_transfer_params: dict
    cached_tokens: int | None  # the prefill engine's prompt cache hit (usage.prompt_tokens_details), if told


def parse_prefill_answer(content: bytes) -> PrefillAnswer:
    """The P leg's JSON answer -> its kv_transfer_params; ValueError (naming what is missing) otherwise."""
    try:
        data = json.loads(content)
    except ValueError as exc:
        raise ValueError(f"prefill answer is not JSON: {exc}") from None
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    if not isinstance(params, dict) or not params:
        raise ValueError("prefill answer has no kv_transfer_params")
    return PrefillAnswer(params, _cached_tokens(data.get("usage")))


def _cached_tokens(usage: Any) -> int | None:
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) else None


# ---- usage: the decode leg's, with the prefill engine's cache hit ------------------------------------------
def rewrite_usage(data: Any, cached_tokens: int) -> bool:
    """Set usage.prompt_tokens_details.cached_tokens to the prefill engine's hit, in place (llm-d's sidecar
    does the same: the decode engine counts every pulled prompt token as cached). True when it changed."""
    usage = data.get("usage") if isinstance(data, dict) else None
    if not isinstance(usage, dict):
        return False
    details = usage.get("prompt_tokens_details")
    usage["prompt_tokens_details"] = {**(details if isinstance(details, dict) else {}), "cached_tokens": cached_tokens}
    return True


def rewrite_json_usage(content: bytes, cached_tokens: int) -> bytes:
    try:
        data = json.loads(content)
    except ValueError:
        return content  # not ours to judge: the client gets the decode engine's bytes
    return json.dumps(data).encode() if rewrite_usage(data, cached_tokens) else content


class SSEUsageRewriter:
    """Rewrites the usage of a server-sent event stream as it passes: complete events go out at once, only an
    event with a non-null `usage` is parsed and re-serialised; every other byte passes through untouched."""

    def __init__(self, cached_tokens: int):
        self.cached_tokens = cached_tokens
        self._pending = b""

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        self._pending += chunk
        while True:
            cut = self._pending.find(b"\n\n")
            if cut < 0:
                return
            event, self._pending = self._pending[: cut + 2], self._pending[cut + 2 :]
            yield self._event(event)

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest

    def _event(self, event: bytes) -> bytes:
        if b'"usage"' not in event or not event.startswith(b"data: "):
            return event
        try:
            data = json.loads(event[6:].strip())
        except ValueError:
            return event
        if not rewrite_usage(data, self.cached_tokens):
            return event
        return b"data: " + json.dumps(data).encode() + b"\n\n"

"""A request as the scheduler sees it: token ids, progress, status. Pure Python (no torch)."""

from __future__ import annotations

import enum
import time

from kvserve.runtime.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2  # preempted by swapping its KV blocks to host memory; resumes where it stopped
    PREEMPTED = 3  # preempted by recompute: its KV was dropped
    # P/D disaggregation (decode engine): blocks allocated, the prompt's KV being pulled from the prefill
    # engine (vLLM's WAITING_FOR_REMOTE_KVS; core/pd_connector.py).
    WAITING_FOR_REMOTE_KVS = 4
    # Ordered so that `status > WAITING_FOR_REMOTE_KVS` means finished.
    FINISHED_STOPPED = 5
    FINISHED_LENGTH = 6
    FINISHED_ABORTED = 7

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.WAITING_FOR_REMOTE_KVS

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence: the scheduler and the KV-cache manager never see more per request. A request for n > 1
    samples is n of these, made by the front (engine/parent_request.py), which share the prompt's full
    blocks through prefix caching."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float | None = None,
        max_tokens: int | None = None,
        lora_name: str | None = None,
        lora_identity: str | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []  # chained hashes of this request's full blocks (kept across preemption)
        self.num_prefix_cache_hit_tokens = 0
        self.first_scheduled_time: float | None = None
        # LoRA (issue 24): the adapter's name (the scheduler caps distinct names per step) and its loaded
        # content identity (the prefix-cache key; lora/adapter.py LoraAdapter.identity). None = base model.
        self.lora_name = lora_name
        self.lora_identity = lora_identity
        # Speculative decoding (spec_decode/): draft tokens for this step, set by the proposer before the
        # scheduler runs. Never part of all_token_ids (so never hashed or prefix-cached) until accepted.
        self.spec_token_ids: list[int] = []
        # P/D disaggregation (core/pd_connector.py): the decode engine pulled (or tried to pull) this prompt's
        # KV already; a prefill engine's kv_transfer_params for the response, set when it finishes.
        self.remote_prefill_done = False
        self.kv_transfer_params_out: dict | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"{self.status.name})"
        )

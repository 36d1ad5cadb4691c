"""What the engine returns per request (vLLM's RequestOutput shape, which users already know)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token: sampled token + top-k
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """time.monotonic() timestamps."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prefix_cache_hit_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    # Set (with finished=True, finish_reason "error") when the engine failed this request: a
    # kvserve.runtime.errors.RequestError (message for the client, retryable or not).
    error: Any = None
    # P/D disaggregation: a prefill engine's params for the decode engine (vLLM's RequestOutput field; the
    # HTTP response returns it as kv_transfer_params). None otherwise.
    kv_transfer_params: dict | None = None


@dataclass
class EngineStats:
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float  # 0..1 of usable blocks held by requests
    num_free_blocks: int
    num_total_blocks: int
    # cumulative counters
    prompt_tokens: int
    generation_tokens: int
    num_preemptions: int
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    # preemption by swapping (preemption_mode="swap")
    num_swap_outs: int = 0  # requests swapped out to host memory
    num_swap_ins: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    num_free_host_blocks: int = 0
    num_total_host_blocks: int = 0
    # --enable-lora: adapter names with requests running / waiting (None: LoRA off)
    running_lora_adapters: tuple[str, ...] | None = None
    waiting_lora_adapters: tuple[str, ...] | None = None
    # --speculative-config (cumulative): decodes that carried drafts, drafted / accepted tokens, and
    # acceptances per draft position (vllm:spec_decode_* counters)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # --kv-offloading-size: the host KV tier ("cpu"; core/host_pool.py). Blocks: capacity and held now, then
    # cumulative -- looked up past a device miss, found, loaded back, saved, evicted; bytes of one block
    # summed over the ranks (each holds its shard), for bytes moved.
    kv_offload_capacity_blocks: int = 0
    kv_offload_used_blocks: int = 0
    kv_offload_lookup_blocks: int = 0
    kv_offload_hit_blocks: int = 0
    kv_offload_loaded_blocks: int = 0
    kv_offload_saved_blocks: int = 0
    kv_offload_evicted_blocks: int = 0
    kv_offload_block_bytes: int = 0
    # --kv-offloading-disk-dir: the disk tier below ("disk"; core/disk_index.py). Blocks: capacity and held
    # now, then cumulative -- fetched into the host tier, written, failed to read (missing or corrupt).
    kv_offload_disk_capacity_blocks: int = 0
    kv_offload_disk_used_blocks: int = 0
    kv_offload_disk_hit_blocks: int = 0
    kv_offload_disk_written_blocks: int = 0
    kv_offload_disk_failed_blocks: int = 0
    # --kv-offloading-remote-url: the remote tier (Redis / Valkey; core/remote_index.py), cumulative blocks --
    # asked of the store, fetched from it into the host tier, handed to the writer, failed to read (missing,
    # corrupt, timed out, store down). Its capacity and occupancy are the store's (INFO memory there).
    kv_offload_remote_enabled: int = 0
    kv_offload_remote_lookup_blocks: int = 0
    kv_offload_remote_hit_blocks: int = 0
    kv_offload_remote_written_blocks: int = 0
    kv_offload_remote_failed_blocks: int = 0
    # --kv-events-config (runtime/kv_events/): cumulative batches the publisher sent on, and batches it dropped
    # because its queue was full (its thread fell behind the engine steps: subscribers then see a sequence gap).
    kv_events_published_batches: int = 0
    kv_events_dropped_batches: int = 0
    # --kv-transfer-config (P/D, core/pd_connector.py): 1 when the connector is on; leases held now and their
    # blocks; cumulative leases expired, prompt tokens pulled, failed pulls (recomputed locally).
    pd_enabled: int = 0
    pd_leases_held: int = 0
    pd_leased_blocks: int = 0
    pd_leases_expired: int = 0
    pd_pulled_tokens: int = 0
    pd_failed_pulls: int = 0

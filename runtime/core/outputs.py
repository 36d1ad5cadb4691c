"""Plain data passed scheduler -> model runner -> scheduler. No torch, so it can be pickled to TP workers."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.runtime.core.block_table_diff import BlockTableDiff
from kvserve.runtime.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """Sent the first time the runner sees a request: what the sampler keeps per request (params, seeded
    generator, penalty history). Kept by the runner across preemption, dropped on finish."""

    req_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    lora_name: str | None = None  # --enable-lora: the adapter this request's tokens run with


@dataclass(slots=True)  # one per scheduled request per step: slots make it cheaper to build and pickle
class ScheduledRequest:
    req_id: str
    token_ids: list[int]  # the tokens whose KV this step computes
    start_position: int  # == the request's num_computed_tokens before this step
    # Change to the request's block table (KV cache group 0) since the runner last saw it (the runner keeps
    # the tables: a decode step sends a handful of appended ids, not every table again -- also what TP
    # pickles per rank).
    block_table: BlockTableDiff
    # Sample a token from this step's last logits row: False mid-prefill (the step ends before the request's
    # last token), True otherwise.
    sample: bool = False
    # Sliding-window models: the same diffs for KV cache groups 1.. (a block that left the window becomes the
    # null block 0: a `replaced` entry).
    group_block_tables: tuple[BlockTableDiff, ...] = ()
    # Speculative decoding: the last num_spec_tokens of token_ids are drafts; the runner verifies them (one
    # logits row per draft plus one) and returns the accepted ones plus the token after them.
    num_spec_tokens: int = 0
    # draft_model, sampled requests: the draft's distribution q at each draft ([num_spec_tokens, vocab] float32
    # numpy rows), for min(1, p/q) acceptance (spec_decode/verify.py); None: drafts with a one-hot q.
    spec_draft_probs: object = None


@dataclass(slots=True)
class KVTransfer:
    """KV of one request moving between the paged cache and somewhere else (another tier, another engine)."""

    block_ids: list[int]  # device blocks of KV cache group 0, in the request's block-table order
    num_tokens: int  # tokens of KV those blocks hold (the last block may be partly filled)
    # The host tier (core/tier_connector.py): the host pool's slots, parallel to block_ids. Empty for a
    # connector that addresses its far side otherwise.
    host_block_ids: list[int] = field(default_factory=list)
    # The blocks' chained hashes, parallel to block_ids, where a store below the host tier files them (the
    # disk tier, core/disk_index.py): a save writes the ones given (b"": not this one), a fetch reads them.
    block_hashes: list[bytes] = field(default_factory=list)
    # P/D disaggregation (core/pd_connector.py): where the KV comes from -- the prefill engine's
    # kv_transfer_params (remote_engine_id, remote_host, remote_port, remote_request_id) with
    # remote_block_ids cut to the blocks pulled, parallel to block_ids.
    remote: dict | None = None


@dataclass
class KVConnectorStep:
    """The KV connector's section of one step (vLLM's KVConnectorMetadata, scheduler -> executor): per
    request, the KV to load into its blocks before this step's forward and the KV to save from its blocks
    after it. Empty while no connector is configured. The host KV tier (--kv-offloading-size,
    core/tier_connector.py) fills it in the scheduler and the runner acts on it (executor/host_tier.py);
    prefill/decode disaggregation does the same with `pull` (core/pd_connector.py, executor/kv_pull.py); the
    executor answers with
    ModelRunnerOutput.finished_sending / finished_receiving (docs/architecture.md, "Where a KV feature plugs
    in")."""

    load: dict[str, KVTransfer] = field(default_factory=dict)  # req id -> KV to bring in before the forward
    save: dict[str, KVTransfer] = field(default_factory=dict)  # req id -> KV to send out after the forward
    # The disk tier: req id -> blocks to read from disk into host slots (no device blocks: block_ids empty),
    # for a load in a later step; and the hashes of blocks the disk tier evicted (files to delete).
    fetch: dict[str, KVTransfer] = field(default_factory=dict)
    drop: list[bytes] = field(default_factory=list)
    # P/D disaggregation: req id -> remote blocks to READ into its blocks (core/pd_connector.py). Started now,
    # finished in some later step (finished_receiving / failed_receiving name the request then): not part of
    # is_empty, which is the host tier's per-step bookkeeping.
    pull: dict[str, KVTransfer] = field(default_factory=dict)
    # P/D, prefill engine: the requests whose blocks are leased now. Every tensor-parallel rank receives its own
    # notification from the decode engine; a lease is released once all ranks have theirs (executor/kv_pull.py).
    leased: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """Nothing for the host tier (its loads and saves complete within the step)."""
        return not self.load and not self.save and not self.fetch and not self.drop


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    new_requests: list[NewRequestData]
    finished_req_ids: list[str]  # finished since the last step: the runner drops their state
    num_preempted: int = 0
    # Run before this step's forward, in this order: device->host (swap out), host->device (swap in).
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    kv_connector: KVConnectorStep = field(default_factory=KVConnectorStep)  # empty: no KV connector

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class TokenLogprobs:
    """Logprobs of one sampled token: its own and the top-k, from the raw (unprocessed) logits."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top: list[tuple[int, float]]  # (token_id, logprob), best first


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # Requests whose own sampling failed this step -> what failed; they got no token (the engine fails them).
    failed: dict[str, str] = field(default_factory=dict)
    # Speculative decoding: for requests scheduled with drafts, the tokens this step produced (the accepted
    # drafts, then the target's own next token: 1 .. num_spec_tokens + 1 of them), instead of sampled_token_ids.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # theirs, if asked for
    # The KV connector's answer (vLLM's KVConnectorOutput): requests whose asynchronous KV save / load
    # (SchedulerOutput.kv_connector) completed since the last step. Empty while no connector is configured;
    # a request waiting for its KV to arrive is scheduled again, one whose KV is being sent keeps its blocks
    # until it appears in finished_sending.
    finished_sending: set[str] = field(default_factory=set)
    finished_receiving: set[str] = field(default_factory=set)
    # Requests whose received KV is incomplete -> positions in their transfer (KVConnectorStep.fetch) that did
    # not arrive (a missing or corrupt disk block): the scheduler recomputes from there. A P/D pull that failed
    # (KVConnectorStep.pull) is here with every position: the request recomputes its prompt locally.
    failed_receiving: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """What one step did for one request."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # P/D disaggregation: a prefill that holds its blocks for a remote decode -> what the decode engine needs
    # (core/pd_connector.py); returned to the client as the response's kv_transfer_params.
    kv_transfer_params: dict | None = None

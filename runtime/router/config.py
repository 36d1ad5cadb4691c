"""The router's settings, in one place: `kvserve router`'s flags are generated from these fields (cli/router.py)
and the replica set, the control loop and the data path read them from here."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.runtime import engine_args
from kvserve.runtime.router.scoring import Weights


@dataclass
class RouterConfig:
    weights: Weights = field(default_factory=Weights)
    # Assumed for a replica that does not report kvserve:kv_capacity_tokens (sizes its prefix index).
    default_capacity_tokens: int = 500_000
    # Prefix-hash block size for a replica that does not report vllm:cache_config_info: the engine's own default.
    default_block_size: int = engine_args.default("block_size")
    poll_interval_s: float = 0.5  # 0: no background scraping or re-probing (tests drive poll_once)
    stale_after_s: float = 2.0
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0  # longest silence from a replica (a non-streamed completion is one silence)
    max_attempts: int = 2  # the first try plus one retry, only before any byte reached the client
    eject_base_s: float = 1.0
    eject_max_s: float = 30.0
    session_header: str | None = None  # e.g. x-session-id: sticky routing for requests carrying it
    replica_api_key: str | None = None  # the replicas' --api-key, for reading their /v1/models (adapter names)
    max_request_body_bytes: int = 32 * 1024 * 1024
    seed: int | None = None
    # Scale from zero: while no replica is ready, hold up to this many requests per model (0: answer 503 at
    # once), each for at most hold_timeout_s, then 503 with Retry-After: hold_retry_after_s.
    max_held_requests: int = 0
    hold_timeout_s: float = 60.0
    hold_retry_after_s: int = 10
    # P/D mode (router/pd.py), active while any replica has the prefill role. The decision per request:
    # conditional (Dynamo's disagg_router rule, with the settings below), always (llm-d's always-disagg decider),
    # never. Remote prefill iff the uncached part is longer than max_local_prefill_length and the best prefill
    # replica has fewer than max_prefill_queue requests waiting.
    pd_decider: str = "conditional"
    max_local_prefill_length: int = 1000  # tokens; Dynamo's max_local_prefill_length
    max_prefill_queue: int = 2  # requests waiting; Dynamo's max_prefill_queue_size
    # Also local when the uncached part is under this fraction of the prompt (0: off): a mostly cached long
    # prompt is not prefilled again on a prefill replica. Issue 42's reading of Dynamo's eff_isl_ratio (0.7).
    remote_prefill_min_uncached_ratio: float = 0.0
    prefill_timeout_s: float = 60.0  # the whole P leg (a long prompt's prefill); past it, aggregated fallback

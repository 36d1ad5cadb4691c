"""ServerConfig: one API server's settings (`kvserve serve`'s server flags take their defaults from it).

Its own module, importing only engine_args, so that `kvserve serve` parses its flags without importing the
server's state (the async engine, metrics, tracing): the engine-core process it prestarts waits for that
parse (issue 43)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.runtime import engine_args


@dataclass
class ServerConfig:
    served_model_names: list[str]
    model_dir: str = ""
    api_key: str | None = None
    max_queue_len: int | None = None  # 429 when this many requests already wait
    drain_timeout_s: float = 30.0
    # --drain-accept-seconds: after the first SIGTERM keep accepting new requests this long while /health
    # answers 503, so a load balancer without a preStop hook (plain Docker, systemd, Nomad) has time to take
    # the endpoint out before new requests would get 503. The drain (drain_timeout_s) starts after it.
    drain_accept_s: float = 0.0
    random_weights: bool = False
    max_request_body_bytes: int = 32 * 1024 * 1024  # larger bodies get 413 (--max-request-body-bytes)
    retry_after_s: int = 1
    log_interval_s: float = 5.0
    tool_call_parser: str | None = None  # hermes | llama3_json: parse tool calls for tool_choice "auto"
    otlp_traces_endpoint: str | None = None  # OpenTelemetry request spans go here (None: tracing off)
    request_tracer: Any = None  # a ready runtime.tracing.RequestTracer (tests); wins over the endpoint
    # --api-server-count N: this is API server `api_server_index` of N sharing one engine core
    # (runtime/server/api_server_group.py): group-wide metrics, and an x-kvserve-api-server response header.
    api_server_index: int = 0
    api_server_count: int = engine_args.default("api_server_count")
    # The group launcher's directory: each server marks itself ready there and /health is 200 only once every
    # server of the group is ready (one port, kernel-balanced: a probe answered by a ready server must not
    # send traffic to one that is still attaching to the core).
    group_dir: str | None = None
    # /v1/load_lora_adapter and /v1/unload_lora_adapter (--allow-runtime-lora-updating, or vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING=True): off by default, as in vLLM.
    allow_runtime_lora_updating: bool = False
    # Where /v1/load_lora_adapter downloads an hf:// or s3:// lora_path (None: ~/.cache/kvserve/lora).
    lora_download_dir: str | None = None
    # Start-up phases timed before the engine started (`kvserve serve`: model_resolve, engine_config), in
    # seconds, and when the command started (time.monotonic()): the "total" phase runs from there to ready.
    startup_phases_s: dict[str, float] = field(default_factory=dict)
    started_monotonic: float | None = None

"""`--kv-transfer-config`: vLLM's KVTransferConfig JSON (vllm/config/kv_transfer.py), the same field names.

Stdlib only: runtime.config (the shared floor) parses it when it builds the engine config. One connector is
implemented, vLLM's NixlConnector (prefill/decode disaggregation over NIXL, docs/disaggregation.md).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvserve.runtime.errors import InvalidParameter, json_object

CONNECTORS = ("NixlConnector",)
ROLES = ("kv_producer", "kv_consumer", "kv_both")
# vLLM's environment defaults (vllm/envs.py): the side channel a decode engine asks for the prefill engine's
# NIXL agent metadata, and how long a prefill engine holds blocks nobody pulled.
SIDE_CHANNEL_HOST_ENV, SIDE_CHANNEL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT"
ABORT_TIMEOUT_ENV = "VLLM_NIXL_ABORT_REQUEST_TIMEOUT"
DEFAULT_SIDE_CHANNEL_PORT = 5600
DEFAULT_ABORT_REQUEST_TIMEOUT_S = 480
DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0  # vLLM's ZMQ handshake timeout

# kv_connector_extra_config keys kvserve reads (others are accepted and ignored, as vLLM's connectors do):
# backends (NIXL plugins, default ["UCX"]), side_channel_host / side_channel_port (override the env),
# abort_request_timeout (s; overrides VLLM_NIXL_ABORT_REQUEST_TIMEOUT), handshake_timeout (s).


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    kv_buffer_device: str = "cpu"
    kv_buffer_size: float = 1e9  # vLLM's field; NIXL registers the KV cache itself, so unused
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_connector_extra_config: dict = field(default_factory=dict)
    kv_load_failure_policy: str = "recompute"
    # Resolved from extra config and vLLM's environment variables:
    side_channel_host: str = "localhost"
    side_channel_port: int = DEFAULT_SIDE_CHANNEL_PORT
    abort_request_timeout_s: float = DEFAULT_ABORT_REQUEST_TIMEOUT_S
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S
    backends: tuple[str, ...] = ("UCX",)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


_FIELD = "kv_transfer_config"
_TYPES: dict[str, tuple] = {
    "kv_connector": (str,),
    "kv_role": (str,),
    "engine_id": (str, type(None)),
    "kv_buffer_device": (str,),
    "kv_buffer_size": (int, float),
    "kv_rank": (int, type(None)),
    "kv_parallel_size": (int,),
    "kv_ip": (str,),
    "kv_port": (int,),
    "kv_connector_extra_config": (dict,),
    "kv_connector_module_path": (str, type(None)),
    "enable_permute_local_kv": (bool,),
    "kv_load_failure_policy": (str,),
}


def _bad(name: str, message: str) -> InvalidParameter:
    return InvalidParameter(f"{_FIELD}.{name}", f"{_FIELD}.{name} {message}")


def parse_kv_transfer_config(value: Any) -> KVTransferConfig | None:
    """A JSON string or a dict -> KVTransferConfig; None for None or "". InvalidParameter naming the field."""
    if value is None or value == "":
        return None
    if isinstance(value, KVTransferConfig):
        return value
    value = json_object(value, _FIELD)
    unknown = sorted(set(value) - set(_TYPES))
    if unknown:
        raise InvalidParameter(_FIELD, f"{_FIELD}: unknown field {unknown[0]!r}; known: {', '.join(sorted(_TYPES))}")
    for name, types in _TYPES.items():
        v = value.get(name)
        if name in value and (not isinstance(v, types) or (bool not in types and isinstance(v, bool))):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise _bad(name, f"must be {want}, got {v!r}")
    if "kv_connector" not in value:
        raise _bad("kv_connector", f"is required (one of {', '.join(CONNECTORS)})")
    if value["kv_connector"] not in CONNECTORS:
        raise _bad("kv_connector", f"must be one of {', '.join(CONNECTORS)}, got {value['kv_connector']!r}")
    if value.get("kv_role") not in ROLES:
        raise _bad(
            "kv_role", f"must be one of {', '.join(ROLES)} (required with kv_connector), got {value.get('kv_role')!r}"
        )
    if value.get("kv_connector_module_path"):
        raise _bad("kv_connector_module_path", "is not supported: kvserve loads no out-of-tree connector")
    if value.get("enable_permute_local_kv"):
        raise _bad("enable_permute_local_kv", "is not supported")
    if value.get("kv_buffer_device", "cpu") not in ("cpu", "cuda"):
        raise _bad("kv_buffer_device", f"must be cpu or cuda, got {value['kv_buffer_device']!r}")
    if value.get("kv_load_failure_policy", "recompute") != "recompute":
        raise _bad(
            "kv_load_failure_policy",
            f"must be recompute (a failed pull is computed locally), got {value['kv_load_failure_policy']!r}",
        )
    if value.get("kv_parallel_size", 1) < 1:
        raise _bad("kv_parallel_size", f"must be >= 1, got {value['kv_parallel_size']}")
    extra = dict(value.get("kv_connector_extra_config", {}))
    kwargs = {k: v for k, v in value.items() if k not in ("kv_connector_module_path", "enable_permute_local_kv")}
    if kwargs.get("engine_id") is None:
        kwargs.pop("engine_id", None)
    kwargs.update(_resolved_extra(extra))
    return KVTransferConfig(**kwargs)


def _resolved_extra(extra: dict) -> dict:
    prefix = "kv_connector_extra_config"
    out: dict[str, Any] = {}
    host = extra.get("side_channel_host", os.environ.get(SIDE_CHANNEL_HOST_ENV, "localhost"))
    if not isinstance(host, str) or not host:
        raise _bad(f"{prefix}.side_channel_host", f"must be a host name or address, got {host!r}")
    out["side_channel_host"] = host
    port = extra.get("side_channel_port", os.environ.get(SIDE_CHANNEL_PORT_ENV, DEFAULT_SIDE_CHANNEL_PORT))
    try:
        port = int(port)
    except (TypeError, ValueError):
        port = -1
    if isinstance(extra.get("side_channel_port"), bool) or not 1 <= port <= 65535:
        raise _bad(
            f"{prefix}.side_channel_port", f"must be a port in [1, 65535], got {extra.get('side_channel_port', port)!r}"
        )
    out["side_channel_port"] = port
    for key, env, default, attr in (
        ("abort_request_timeout", ABORT_TIMEOUT_ENV, DEFAULT_ABORT_REQUEST_TIMEOUT_S, "abort_request_timeout_s"),
        ("handshake_timeout", None, DEFAULT_HANDSHAKE_TIMEOUT_S, "handshake_timeout_s"),
    ):
        raw = extra.get(key, os.environ.get(env, default) if env else default)
        try:
            seconds = float(raw)
        except (TypeError, ValueError):
            seconds = -1.0
        if isinstance(raw, bool) or not seconds > 0:
            raise _bad(f"{prefix}.{key}", f"must be a number of seconds > 0, got {raw!r}")
        out[attr] = seconds
    backends = extra.get("backends", ["UCX"])
    if not isinstance(backends, list) or not backends or not all(isinstance(b, str) for b in backends):
        raise _bad(f"{prefix}.backends", f"must be a non-empty list of NIXL backend names, got {backends!r}")
    out["backends"] = tuple(backends)
    return out

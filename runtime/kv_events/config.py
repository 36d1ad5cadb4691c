"""`--kv-events-config`: vLLM's KVEventsConfig JSON, the same fields and defaults (vllm/config/kv_events.py).

Stdlib only: runtime.config (the shared floor) parses it when it builds the engine config.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvserve.runtime.errors import InvalidParameter, json_object

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when enabled, else "null" (vLLM's __post_init__)
    endpoint: str = "tcp://*:5557"  # PUB socket: binds when it holds * or :: (or is ipc/inproc), else connects
    replay_endpoint: str | None = None  # ROUTER socket answering replay requests; None: no replay
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark (messages beyond it are dropped by ZMQ)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; beyond it they are dropped
    topic: str = ""  # the first frame of every message; subscribers filter by its prefix
    snapshot_endpoint: str | None = None  # newer vLLM; not supported here (a clear error if set)

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"


_FIELD = "kv_events_config"


def parse_kv_events_config(value: Any) -> KVEventsConfig | None:
    """A JSON string or a dict (LLM(kv_events_config=...)) -> KVEventsConfig; None for None or "".
    InvalidParameter naming the field for anything vLLM would reject."""
    if value is None or value == "":
        return None
    if isinstance(value, KVEventsConfig):
        return value
    value = json_object(value, _FIELD)
    known = {f.name for f in fields(KVEventsConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidParameter(_FIELD, f"{_FIELD}: unknown field {unknown[0]!r}; known: {', '.join(sorted(known))}")
    checks = {
        "enable_kv_cache_events": (bool,),
        "publisher": (str, type(None)),
        "endpoint": (str,),
        "replay_endpoint": (str, type(None)),
        "buffer_steps": (int,),
        "hwm": (int,),
        "max_queue_size": (int,),
        "topic": (str,),
        "snapshot_endpoint": (str, type(None)),
    }
    for name, types in checks.items():
        if name in value and (not isinstance(value[name], types) or (bool not in types and value[name] is True)):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise InvalidParameter(f"{_FIELD}.{name}", f"{_FIELD}.{name} must be {want}, got {value[name]!r}")
    if value.get("publisher") not in (None, *PUBLISHERS):
        raise InvalidParameter(
            f"{_FIELD}.publisher",
            f"{_FIELD}.publisher must be one of {', '.join(PUBLISHERS)}, got {value['publisher']!r}",
        )
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        if name in value and value[name] < 1:
            raise InvalidParameter(f"{_FIELD}.{name}", f"{_FIELD}.{name} must be >= 1, got {value[name]}")
    if value.get("snapshot_endpoint"):
        raise InvalidParameter(
            f"{_FIELD}.snapshot_endpoint",
            f"{_FIELD}.snapshot_endpoint: snapshots are not supported; use replay_endpoint (replay from sequence 0)",
        )
    for name in ("endpoint", "replay_endpoint"):
        endpoint = value.get(name)
        if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise InvalidParameter(
                f"{_FIELD}.{name}", f"{_FIELD}.{name} must be a tcp://, ipc:// or inproc:// address, got {endpoint!r}"
            )
    return KVEventsConfig(**value)

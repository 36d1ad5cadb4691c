"""Pure renderer for `spec.router.kvEvents` (issue 40): the engines publish their KV cache events, the routers
subscribe to every engine's, so each router replica holds the same exact index (docs/router.md, KV events).

What it adds to the rendered children, each piece called from where that child is rendered:
- the engine: `--kv-events-config` (vLLM's KVEventsConfig JSON, runtime/kv_events/config.py) with a PUB socket
  bound on `port` and a replay ROUTER socket on `replayPort`, both on every address (`tcp://*:P`), and the two
  ports declared on its container (`kv-events`, `kv-replay`);
- the router: `--kv-events-port` / `--kv-events-replay-port`: it subscribes to tcp://<pod IP>:port of every
  engine pod it finds in the engine Service's EndpointSlices (cli/router_kv_events.py);
- the engine NetworkPolicy: both ports open to this InferenceService's router pods only.

When it is on and what the spec may not combine with it: operator/kv_events.py (enabled, check).
"""

from __future__ import annotations

import json
from typing import Any

from kvserve.operator.kv_events import enabled
from kvserve.operator.labels import router_selector
from kvserve.operator.spec_model import InferenceServiceSpec

EVENTS_PORT_NAME = "kv-events"  # container port names: at most 15 characters
REPLAY_PORT_NAME = "kv-replay"


def engine_config(spec: InferenceServiceSpec) -> str:
    """The engine's `--kv-events-config` value: vLLM's fields; the topic stays "" (one socket per engine, the
    router subscribes to all of it)."""
    events = spec.router.kv_events
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events.port}",
            "replay_endpoint": f"tcp://*:{events.replay_port}",
        },
        separators=(",", ":"),
    )


def engine_settings(spec: InferenceServiceSpec) -> dict[str, Any]:
    """EngineArgs values for render.engine_settings (empty when off)."""
    return {"kv_events_config": engine_config(spec)} if enabled(spec) else {}


def container_ports(spec: InferenceServiceSpec) -> list[dict]:
    """The engine container's event ports (documentation for `kubectl describe`; the NetworkPolicy names
    numbers)."""
    if not enabled(spec):
        return []
    events = spec.router.kv_events
    return [
        {"name": EVENTS_PORT_NAME, "containerPort": events.port, "protocol": "TCP"},
        {"name": REPLAY_PORT_NAME, "containerPort": events.replay_port, "protocol": "TCP"},
    ]


def router_args(spec: InferenceServiceSpec) -> list[str]:
    """The router's subscription flags (empty when off)."""
    if not enabled(spec):
        return []
    events = spec.router.kv_events
    return ["--kv-events-port", str(events.port), "--kv-events-replay-port", str(events.replay_port)]


def network_policy_ingress(spec: InferenceServiceSpec, name: str) -> list[dict]:
    """The engine NetworkPolicy's rule for the event ports: from this InferenceService's router pods only (the
    events name every cached prefix's tokens, so they are no more public than the prompts)."""
    if not enabled(spec):
        return []
    events = spec.router.kv_events
    return [
        {
            "from": [{"podSelector": {"matchLabels": router_selector(name)}}],
            "ports": [{"protocol": "TCP", "port": events.port}, {"protocol": "TCP", "port": events.replay_port}],
        }
    ]

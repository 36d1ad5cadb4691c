"""`spec.router.kvEvents` (issue 40): when the engines publish KV events and the routers subscribe, and what a
spec may not combine with them. Pure: spec in, a bool or a message naming the field out (spec.resolve raises it
as SpecError InvalidKVEvents; render/kv_events.py renders the flags, ports and NetworkPolicy rule)."""

from __future__ import annotations

from kvserve.operator.spec_model import InferenceServiceSpec

KV_EVENTS_FLAG = "--kv-events-config"


def enabled(spec: InferenceServiceSpec) -> bool:
    """Do the engines publish KV events and the routers subscribe? Only with a router: router.kvEvents.enabled
    when set, else whether there are two or more router replicas. An estimating router learns only from its
    own decisions, so N of them each see 1/N of the traffic (docs/router.md measured the hit rate falling from
    0.81 to 0.72 with two); on the events they all see every engine's cache. One router may turn it on too
    (it then follows evictions and restarts exactly); enabled false keeps estimating routers."""
    if not spec.router.enabled:
        return False
    explicit = spec.router.kv_events.enabled
    return explicit if explicit is not None else spec.router.replicas >= 2


def check(spec: InferenceServiceSpec) -> str | None:
    """The CRD's CEL rules on router.kvEvents (for `kvserve render` and clusters without them), and a conflict
    the CRD cannot see: --kv-events-config in extraArgs while the operator renders its own. None: fine."""
    events, port = spec.router.kv_events, spec.port
    if events.port == events.replay_port:
        return f"spec.router.kvEvents.port and spec.router.kvEvents.replayPort must differ (both {events.port})"
    for field, value in (("port", events.port), ("replayPort", events.replay_port)):
        if value == port:
            return f"spec.router.kvEvents.{field} ({value}) must differ from spec.port: the engine serves HTTP there"
    if enabled(spec) and any(str(a).split("=", 1)[0] == KV_EVENTS_FLAG for a in spec.engine.extra_args or []):
        return (
            f"spec.engine.extraArgs carries {KV_EVENTS_FLAG} while spec.router.kvEvents renders one (router.replicas "
            ">= 2 or kvEvents.enabled): drop it from extraArgs (set router.kvEvents.port/replayPort instead), or "
            "set router.kvEvents.enabled false"
        )
    return None

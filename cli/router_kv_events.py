"""`kvserve router`'s KV-event flags: where the replicas publish their KV events (docs/router.md, KV events)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    events = parser.add_argument_group(
        "KV events: score replicas from their own cache events (kvserve or vLLM --kv-events-config)"
    )
    events.add_argument(
        "--kv-events-port",
        type=int,
        default=None,
        metavar="PORT",
        help="subscribe to every replica's events at tcp://<replica host>:PORT (its --kv-events-config endpoint)",
    )
    events.add_argument(
        "--kv-events-replay-port",
        type=int,
        default=None,
        metavar="PORT",
        help="with --kv-events-port: the replicas' replay_endpoint port, for recovering gaps and resyncs",
    )
    events.add_argument(
        "--kv-events-endpoint",
        action="append",
        default=[],
        metavar="URL=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT]",
        help="one replica's event endpoints (repeatable; wins over --kv-events-port for that replica)",
    )
    events.add_argument(
        "--kv-events-topic", default="", help="subscribe to messages whose topic starts with this (default: all)"
    )
    events.add_argument(
        "--kv-events-stale-after",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="a replica silent this long (kvserve heartbeats every second) is scored from the router's "
        "estimate instead; 0: never stale (engines that send no heartbeats when idle) (default 5)",
    )


def build(args: argparse.Namespace):
    """The subscriptions for the router, None when no event flag is given; ValueError naming a bad flag."""
    if args.kv_events_port is None and not args.kv_events_endpoint:
        if args.kv_events_replay_port is not None:
            raise ValueError("--kv-events-replay-port needs --kv-events-port")
        return None
    for flag, port in (
        ("--kv-events-port", args.kv_events_port),
        ("--kv-events-replay-port", args.kv_events_replay_port),
    ):
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"{flag} must be a TCP port (1-65535), got {port}")
    if args.kv_events_stale_after < 0:
        raise ValueError(f"--kv-events-stale-after must be >= 0, got {args.kv_events_stale_after}")
    from kvserve.runtime.router.kv_subscriber import EventEndpoints, KVEventSubscriptions

    endpoints = EventEndpoints(
        explicit=EventEndpoints.parse_explicit(args.kv_events_endpoint),
        port=args.kv_events_port,
        replay_port=args.kv_events_replay_port,
        topic=args.kv_events_topic,
    )
    return KVEventSubscriptions(endpoints, stale_after_s=args.kv_events_stale_after)

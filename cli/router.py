"""`kvserve router`: an OpenAI-compatible reverse proxy that routes each request to the replica most likely
to hold its prompt's prefix in KV cache, balanced against load (kvserve.runtime.router, docs/router.md)."""

from __future__ import annotations

import argparse
import os
import sys

from kvserve.cli import router_kv_events
from kvserve.runtime.engine_args import positive_int as _positive_int  # one definition of the flag type

HELP = "cache- and load-aware router in front of several `kvserve serve` replicas"


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_argument_group("replicas (one of)")
    where.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="URL",
        help="a replica's base URL, e.g. http://127.0.0.1:8001 (repeatable)",
    )
    where.add_argument(
        "--service", default=None, help="in a cluster: route to the ready endpoints of this Service's EndpointSlices"
    )
    parser.add_argument(
        "--namespace", default=None, help="with --service: its namespace (default: the pod's own, else 'default')"
    )
    parser.add_argument("--port-name", default="http", help="with --service: the EndpointSlice port to use")
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="MODEL_DIR",
        help="model directory whose tokenizer and chat template the replicas use; without it "
        "prefix affinity is off and requests are routed on load only",
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on")
    parser.add_argument(
        "--block-size",
        type=_positive_int,
        default=16,
        help="prefix-hash block size when a replica does not report vllm:cache_config_info",
    )
    parser.add_argument(
        "--default-capacity-tokens",
        type=_positive_int,
        default=500_000,
        help="KV capacity assumed for a replica that does not report kvserve:kv_capacity_tokens "
        "(sizes its prefix index)",
    )
    parser.add_argument(
        "--weight-prefill",
        type=_non_negative,
        default=3.0,
        help="weight of the prefill work ahead (uncached prompt tokens, this request's and queued)",
    )
    parser.add_argument("--weight-prefix", type=_non_negative, default=1.0, help="prefix-match-ratio weight")
    parser.add_argument("--weight-queue", type=_non_negative, default=2.0, help="queue/load weight")
    parser.add_argument("--weight-kv", type=_non_negative, default=1.0, help="free-KV weight")
    parser.add_argument("--weight-session", type=_non_negative, default=4.0, help="session-affinity weight")
    parser.add_argument(
        "--weight-adapter",
        type=_non_negative,
        default=3.0,
        help="LoRA adapter-affinity weight: prefer replicas where the requested adapter is running or has a free slot",
    )
    parser.add_argument(
        "--replica-api-key",
        default=None,
        help="the replicas' --api-key, to read their /v1/models (which names are LoRA adapters, where they are "
        "served); also read from KVSERVE_API_KEY",
    )
    parser.add_argument(
        "--prefill-scale",
        type=float,
        default=2048.0,
        help="prompt tokens of extra prefill work that cost the whole prefill weight",
    )
    parser.add_argument(
        "--queue-scale", type=float, default=8.0, help="requests of extra load that cost the whole queue weight"
    )
    parser.add_argument(
        "--max-imbalance",
        type=int,
        default=8,
        help="prefix affinity is ignored on a replica this many requests busier than the least-loaded one",
    )
    parser.add_argument(
        "--session-header", default=None, help="request header naming a session (e.g. x-session-id) for sticky routing"
    )
    parser.add_argument(
        "--max-attempts",
        type=_positive_int,
        default=2,
        help="replicas tried per request before any byte reached the client (default 2)",
    )
    parser.add_argument("--poll-interval", type=float, default=0.5, help="seconds between /metrics scrapes")
    parser.add_argument(
        "--read-timeout",
        type=float,
        default=600.0,
        help="longest silence from a replica, in seconds (a non-streamed completion is one)",
    )
    hold = parser.add_argument_group("scale from zero: requests held while no replica is ready")
    hold.add_argument(
        "--max-held-requests",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help='hold up to N requests per model (the body\'s "model") while no replica is ready, and forward '
        "them in order once one is; past N a 503 with Retry-After. 0 (default): answer 503 at once",
    )
    hold.add_argument(
        "--hold-timeout",
        type=_positive_float,
        default=60.0,
        metavar="SECONDS",
        help="longest a request is held (default 60); then a 503 with Retry-After",
    )
    hold.add_argument(
        "--hold-retry-after",
        type=_positive_int,
        default=10,
        metavar="SECONDS",
        help="Retry-After of those 503s (default 10)",
    )
    router_kv_events.add_arguments(parser)
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="debug logs every routing decision with its scores",
    )


def _namespace(explicit: str | None) -> str:
    if explicit:
        return explicit
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace", encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return "default"


def run(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if bool(args.backend) == bool(args.service):
        print("kvserve router: give either --backend URL (repeatable) or --service NAME", file=sys.stderr)
        return 2
    bad = [u for u in args.backend if not u.startswith(("http://", "https://"))]
    if bad:
        print(f"kvserve router: --backend must be an http(s) URL, got {bad[0]!r}", file=sys.stderr)
        return 2

    import uvicorn

    from kvserve.runtime.router import discovery
    from kvserve.runtime.router.proxy import Router, RouterConfig, build_app
    from kvserve.runtime.router.scoring import Weights

    try:
        weights = Weights(
            prefill=args.weight_prefill,
            prefix=args.weight_prefix,
            queue=args.weight_queue,
            kv=args.weight_kv,
            session=args.weight_session,
            adapter=args.weight_adapter,
            prefill_scale=args.prefill_scale,
            queue_scale=args.queue_scale,
            max_imbalance=args.max_imbalance,
        )
    except ValueError as exc:
        print(f"kvserve router: {exc}", file=sys.stderr)
        return 2
    tokenizer = None
    if args.tokenizer:
        from kvserve.runtime.errors import InvalidParameter
        from kvserve.runtime.router.prompt import PromptTokenizer

        try:
            tokenizer = PromptTokenizer(args.tokenizer)
        except InvalidParameter as exc:
            print(f"kvserve router: --tokenizer: {exc}", file=sys.stderr)
            return 2
    else:
        logging.getLogger("kvserve.router").warning("no --tokenizer: prefix affinity is off, routing on load only")
    if args.backend:
        found = discovery.static(args.backend)
    else:
        found = discovery.EndpointSliceWatcher(_namespace(args.namespace), args.service, args.port_name)
    config = RouterConfig(
        weights=weights,
        default_capacity_tokens=args.default_capacity_tokens,
        default_block_size=args.block_size,
        poll_interval_s=args.poll_interval,
        read_timeout_s=args.read_timeout,
        max_attempts=args.max_attempts,
        session_header=args.session_header,
        replica_api_key=args.replica_api_key or os.environ.get("KVSERVE_API_KEY") or None,
        max_held_requests=args.max_held_requests,
        hold_timeout_s=args.hold_timeout,
        hold_retry_after_s=args.hold_retry_after,
    )
    try:
        kv_events = router_kv_events.build(args)
    except ValueError as exc:
        print(f"kvserve router: {exc}", file=sys.stderr)
        return 2
    app = build_app(Router(config, tokenizer, found, kv_events=kv_events))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0

"""`kvserve router`: an OpenAI-compatible reverse proxy that routes each request to the replica most likely
to hold its prompt's prefix in KV cache, balanced against load (kvserve.runtime.router, docs/router.md)."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import MISSING, dataclass, fields
from typing import Any, Callable

from kvserve.cli import router_kv_events
from kvserve.runtime.engine_args import positive_int as _positive_int  # one definition of the flag type
from kvserve.runtime.router.config import RouterConfig
from kvserve.runtime.router.pd import DECIDERS, check_decider
from kvserve.runtime.router.scoring import Weights

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


def _decider(text: str) -> str:
    try:
        return check_decider(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ratio(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


@dataclass(frozen=True)
class Flag:
    """One flag generated from a RouterConfig or Weights field: its default is the field's (one home), the
    flag only adds the parsing and the help text."""

    flag: str
    field: str
    type: Callable[[str], Any] | None
    help: str
    metavar: str | None = None

    @property
    def dest(self) -> str:  # argparse's own: --weight-prefill -> weight_prefill
        return self.flag.lstrip("-").replace("-", "_")

    def default(self, owner: type) -> Any:
        f = next(f for f in fields(owner) if f.name == self.field)
        return f.default_factory() if f.default is MISSING else f.default

    def add(self, parser: Any, owner: type) -> None:
        extra = {"type": self.type} if self.type is not None else {}
        if self.metavar:
            extra["metavar"] = self.metavar
        parser.add_argument(self.flag, default=self.default(owner), help=self.help, **extra)


# Weights' fields, in the order docs/router.md explains them.
WEIGHT_FLAGS = (
    Flag(
        "--weight-prefill",
        "prefill",
        _non_negative,
        "weight of the prefill work ahead (uncached prompt tokens, this request's and queued)",
    ),
    Flag("--weight-prefix", "prefix", _non_negative, "prefix-match-ratio weight"),
    Flag("--weight-queue", "queue", _non_negative, "queue/load weight"),
    Flag("--weight-kv", "kv", _non_negative, "free-KV weight"),
    Flag("--weight-session", "session", _non_negative, "session-affinity weight"),
    Flag(
        "--weight-adapter",
        "adapter",
        _non_negative,
        "LoRA adapter-affinity weight: prefer replicas where the requested adapter is running or has a free slot",
    ),
    Flag(
        "--prefill-scale",
        "prefill_scale",
        float,
        "prompt tokens of extra prefill work that cost the whole prefill weight",
    ),
    Flag("--queue-scale", "queue_scale", float, "requests of extra load that cost the whole queue weight"),
    Flag(
        "--max-imbalance",
        "max_imbalance",
        int,
        "prefix affinity is ignored on a replica this many requests busier than the least-loaded one",
    ),
)
# RouterConfig's fields that `kvserve router` exposes (the rest are for tests and embedding).
CONFIG_FLAGS = (
    Flag(
        "--block-size",
        "default_block_size",
        _positive_int,
        "prefix-hash block size when a replica does not report vllm:cache_config_info",
    ),
    Flag(
        "--default-capacity-tokens",
        "default_capacity_tokens",
        _positive_int,
        "KV capacity assumed for a replica that does not report kvserve:kv_capacity_tokens (sizes its prefix index)",
    ),
    Flag(
        "--session-header",
        "session_header",
        None,
        "request header naming a session (e.g. x-session-id) for sticky routing",
    ),
    Flag(
        "--replica-api-key",
        "replica_api_key",
        None,
        "the replicas' --api-key, to read their /v1/models (which names are LoRA adapters, where they are "
        "served); also read from KVSERVE_API_KEY",
    ),
    Flag(
        "--max-attempts",
        "max_attempts",
        _positive_int,
        "replicas tried per request before any byte reached the client",
    ),
    Flag("--poll-interval", "poll_interval_s", float, "seconds between /metrics scrapes"),
    Flag(
        "--read-timeout",
        "read_timeout_s",
        float,
        "longest silence from a replica, in seconds (a non-streamed completion is one)",
    ),
)
HOLD_FLAGS = (
    Flag(
        "--max-held-requests",
        "max_held_requests",
        _non_negative_int,
        'hold up to N requests per model (the body\'s "model") while no replica is ready, and forward them in '
        "order once one is; past N a 503 with Retry-After; 0: answer 503 at once (default: %(default)s)",
        metavar="N",
    ),
    Flag(
        "--hold-timeout",
        "hold_timeout_s",
        _positive_float,
        "longest a request is held; then a 503 with Retry-After",
        metavar="SECONDS",
    ),
    Flag(
        "--hold-retry-after",
        "hold_retry_after_s",
        _positive_int,
        "Retry-After of those 503s",
        metavar="SECONDS",
    ),
)


# P/D mode (docs/router.md, "Router P/D mode"): on while any replica has the prefill role.
PD_FLAGS = (
    Flag(
        "--pd-decider",
        "pd_decider",
        _decider,
        f"per request, prefill on a prefill replica or not: {', '.join(DECIDERS)} -- conditional is Dynamo's "
        "rule with the settings below, always is llm-d's always-disagg decider (default: %(default)s)",
    ),
    Flag(
        "--max-local-prefill-length",
        "max_local_prefill_length",
        _non_negative_int,
        "conditional: an uncached prompt part (prompt minus the decode replica's cached prefix) of at most this "
        "many tokens is prefilled on the decode replica (Dynamo's max_local_prefill_length; default: %(default)s)",
        metavar="TOKENS",
    ),
    Flag(
        "--max-prefill-queue",
        "max_prefill_queue",
        _positive_int,
        "conditional: the prefill pool is saturated (prefill locally) when its best replica has this many "
        "requests waiting (Dynamo's max_prefill_queue_size; default: %(default)s)",
        metavar="N",
    ),
    Flag(
        "--remote-prefill-min-uncached-ratio",
        "remote_prefill_min_uncached_ratio",
        _ratio,
        "conditional: also prefill locally when the uncached part is under this fraction of the prompt "
        "(0: off; default: %(default)s)",
        metavar="RATIO",
    ),
    Flag(
        "--prefill-timeout",
        "prefill_timeout_s",
        _positive_float,
        "longest prefill leg; past it the request is served aggregated on the decode replica (default: %(default)s)",
        metavar="SECONDS",
    ),
)


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
        "--prefill-backend",
        action="append",
        default=[],
        metavar="URL",
        help="P/D mode: a prefill replica's base URL (repeatable): it takes only prefill legs",
    )
    where.add_argument(
        "--decode-backend",
        action="append",
        default=[],
        metavar="URL",
        help="P/D mode: a decode replica's base URL (repeatable): decode legs and requests prefilled locally",
    )
    where.add_argument(
        "--service", default=None, help="in a cluster: route to the ready endpoints of this Service's EndpointSlices"
    )
    parser.add_argument(
        "--namespace", default=None, help="with --service: its namespace (default: the pod's own, else 'default')"
    )
    parser.add_argument("--port-name", default="http", help="with --service: the EndpointSlice port to use")
    parser.add_argument(
        "--role-label",
        default=None,
        metavar="LABEL",
        help="with --service, P/D mode: the pod label naming each replica's role, as llm-d does (llm-d.ai/role: "
        "prefill, decode, prefill-decode; no label: both); needs RBAC to list pods",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="MODEL_DIR",
        help="model directory whose tokenizer and chat template the replicas use; without it "
        "prefix affinity is off and requests are routed on load only",
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on")
    for flag in WEIGHT_FLAGS:
        flag.add(parser, Weights)
    for flag in CONFIG_FLAGS:
        flag.add(parser, RouterConfig)
    hold = parser.add_argument_group("scale from zero: requests held while no replica is ready")
    for flag in HOLD_FLAGS:
        flag.add(hold, RouterConfig)
    pd = parser.add_argument_group("P/D mode: disaggregated prefill and decode (vLLM kv_transfer_params)")
    for flag in PD_FLAGS:
        flag.add(pd, RouterConfig)
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
    static = args.backend + args.prefill_backend + args.decode_backend
    if bool(static) == bool(args.service):
        print(
            "kvserve router: give either --backend/--prefill-backend/--decode-backend URL (repeatable) or "
            "--service NAME",
            file=sys.stderr,
        )
        return 2
    for flag in ("backend", "prefill_backend", "decode_backend"):
        bad = [u for u in getattr(args, flag) if not u.startswith(("http://", "https://"))]
        if bad:
            print(f"kvserve router: --{flag.replace('_', '-')} must be an http(s) URL, got {bad[0]!r}", file=sys.stderr)
            return 2
    if args.prefill_backend and not (args.backend or args.decode_backend):
        print("kvserve router: --prefill-backend needs a --decode-backend (or --backend) to decode", file=sys.stderr)
        return 2
    if args.role_label and not args.service:
        print("kvserve router: --role-label needs --service (static replicas take --prefill-backend)", file=sys.stderr)
        return 2

    import uvicorn

    from kvserve.runtime.router import discovery
    from kvserve.runtime.router.app import build_app
    from kvserve.runtime.router.proxy import Router

    try:
        weights = Weights(**{flag.field: getattr(args, flag.dest) for flag in WEIGHT_FLAGS})
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
    if static:
        found = discovery.static(args.backend, args.prefill_backend, args.decode_backend)
    else:
        found = discovery.EndpointSliceWatcher(
            _namespace(args.namespace), args.service, args.port_name, role_label=args.role_label
        )
    given = {flag.field: getattr(args, flag.dest) for flag in CONFIG_FLAGS + HOLD_FLAGS + PD_FLAGS}
    given["replica_api_key"] = given["replica_api_key"] or os.environ.get("KVSERVE_API_KEY") or None
    config = RouterConfig(weights=weights, **given)
    try:
        kv_events = router_kv_events.build(args)
    except ValueError as exc:
        print(f"kvserve router: {exc}", file=sys.stderr)
        return 2
    app = build_app(Router(config, tokenizer, found, kv_events=kv_events))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0

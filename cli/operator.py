"""`kvserve operator`: run the kopf operator against the in-cluster config or the current kubeconfig."""
from __future__ import annotations

import argparse
import sys

HELP = "Run the InferenceService operator (kopf) against the current cluster"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--namespace", action="append", default=[],
                        help="namespace to watch (repeatable; default: all namespaces)")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                        help="kopf liveness endpoint URL ('' to disable)")
    parser.add_argument("--metrics-port", type=int, default=8081,
                        help="serve the operator's Prometheus /metrics on this port (0 to disable)")
    parser.add_argument("--metrics-host", default="0.0.0.0", help="bind address of /metrics")
    parser.add_argument("--verbose", action="store_true")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    import kopf

    from kvserve.operator import handlers  # noqa: F401  (registers the handlers)

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if args.metrics_port:
        from kvserve.operator import metrics

        try:
            metrics.serve(args.metrics_port, addr=args.metrics_host)
        except OSError as exc:
            print(f"kvserve operator: cannot serve /metrics on {args.metrics_host}:{args.metrics_port}: {exc}",
                  file=sys.stderr)
            return 2
    # One replica with a Recreate strategy (the chart's default): no peering objects to manage.
    asyncio.run(kopf.operator(
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace or (),
        liveness_endpoint=args.liveness or None,
    ))
    return 0

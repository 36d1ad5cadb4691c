"""`kvserve operator`: run the kopf operator against the in-cluster config or the current kubeconfig."""

from __future__ import annotations

import argparse
import os
import sys

HELP = "Run the InferenceService operator (kopf) against the current cluster"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="namespace to watch (repeatable; default: all namespaces)",
    )
    parser.add_argument(
        "--liveness", default="http://0.0.0.0:8080/healthz", help="kopf liveness endpoint URL ('' to disable)"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=8081,
        help="serve the operator's Prometheus /metrics on this port (0 to disable)",
    )
    parser.add_argument("--metrics-host", default="0.0.0.0", help="bind address of /metrics")
    parser.add_argument("--verbose", action="store_true", help="debug logging (kopf's --verbose)")
    election = parser.add_argument_group("leader election (several replicas; see kvserve.operator.leader)")
    election.add_argument(
        "--leader-elect",
        action="store_true",
        help="run only while holding a coordination.k8s.io Lease; stand by otherwise",
    )
    election.add_argument(
        "--lease-name",
        default="kvserve-operator",
        help="name of the coordination.k8s.io Lease the replicas elect a leader on",
    )
    election.add_argument(
        "--lease-namespace",
        default=os.environ.get("POD_NAMESPACE") or "default",
        help="namespace of the Lease (default: $POD_NAMESPACE, else 'default')",
    )
    election.add_argument(
        "--lease-duration",
        type=int,
        default=15,
        metavar="SECONDS",
        help="seconds a leader's Lease is valid without renewal",
    )
    election.add_argument(
        "--renew-deadline",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="seconds the leader keeps trying to renew before it stops writing",
    )
    election.add_argument(
        "--retry-period",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="seconds between attempts to acquire or renew the Lease",
    )


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    import kopf

    from kvserve.operator import handlers, kube, leader  # noqa: F401  (handlers registers the handlers)

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    if args.metrics_port:  # before the election: a standby serves /metrics too (its reconcile series stay empty)
        from kvserve.operator import metrics

        try:
            metrics.serve(args.metrics_port, addr=args.metrics_host)
        except OSError as exc:
            print(
                f"kvserve operator: cannot serve /metrics on {args.metrics_host}:{args.metrics_port}: {exc}",
                file=sys.stderr,
            )
            return 2

    async def operate(stop_flag: asyncio.Event | None = None) -> None:
        # kopf's own peering stays off (standalone): with --leader-elect only the Lease holder runs kopf at all.
        await kopf.operator(
            standalone=True,
            clusterwide=not args.namespace,
            namespaces=args.namespace or (),
            liveness_endpoint=args.liveness or None,
            stop_flag=stop_flag,
        )

    if not args.leader_elect:
        asyncio.run(operate())
        return 0
    settings = leader.LeaseSettings(
        name=args.lease_name,
        namespace=args.lease_namespace,
        identity=leader.default_identity(),
        lease_duration_s=args.lease_duration,
        renew_deadline_s=args.renew_deadline,
        retry_period_s=args.retry_period,
    )
    if kube._client is None:
        kube.configure()
    return asyncio.run(leader.run_elected(leader.Elector(settings), operate, args.liveness or None))

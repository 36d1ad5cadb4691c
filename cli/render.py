"""`kvserve render -f FILE.yaml`: the manifests the operator would create, from the same pure renderer."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "Print the Deployment/Service/HPA/PDB the operator would create for InferenceService manifests"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--filename", required=True, help="YAML file with InferenceService(s); - for stdin")
    parser.add_argument("-n", "--namespace", default="default", help="namespace when the manifest sets none")
    parser.add_argument(
        "-o",
        "--output",
        choices=["yaml", "json"],
        default="yaml",
        help="output format: YAML documents, or one JSON List",
    )
    parser.add_argument(
        "--status",
        action="store_true",
        help="also print each InferenceService's status as the operator would first write it (plan, layout, "
        "conditions; before any pod exists): a YAML comment after its manifests, or a 'statuses' map with -o json",
    )


def render_documents(
    docs: list[dict], default_namespace: str
) -> tuple[list[dict], list[str], dict[str, tuple[list[dict], dict]]]:
    """(child manifests, error lines, {namespace/name: (its manifests, its planned status)}) for every
    InferenceService in `docs`; other kinds are skipped."""
    from kvserve.cli.plan import resolve_like_operator
    from kvserve.operator import render
    from kvserve.operator import spec as spec_mod

    objs: list[dict] = []
    errors: list[str] = []
    per_service: dict[str, tuple[list[dict], dict]] = {}
    for doc in docs:
        if not doc or doc.get("kind") != spec_mod.KIND:
            continue
        meta = doc.get("metadata") or {}
        name, namespace = meta["name"], meta.get("namespace", default_namespace)
        try:
            resolved = resolve_like_operator(doc.get("spec") or {})  # fetches a non-catalog config.json
        except spec_mod.SpecError as exc:
            errors.append(f"{namespace}/{name}: {exc.reason}: {exc.message}")
            per_service[f"{namespace}/{name}"] = ([], planned_status(doc, name, namespace, None, exc))
            continue
        if not resolved.plan.fits:
            errors.append(f"{namespace}/{name}: {resolved.plan.reason}: {resolved.plan.message}")
        children = render.render(resolved, name, namespace)
        objs.extend(children)
        per_service[f"{namespace}/{name}"] = (children, planned_status(doc, name, namespace, resolved, None))
    return objs, errors, per_service


def planned_status(doc: dict, name: str, namespace: str, resolved, error) -> dict:
    """The status the operator's first reconcile writes (operator/status.py, no workload observed yet), from
    the same resolution, so `--status` cannot drift from what `kubectl get kvs -o yaml` will show."""
    import datetime

    from kvserve.operator import spec as spec_mod
    from kvserve.operator import status as status_mod

    layout = resolved.layout if resolved is not None else None
    multinode = layout is not None and layout.multinode
    return status_mod.compute_status(
        name=name,
        namespace=namespace,
        spec=resolved.spec if resolved is not None else spec_mod.best_effort(doc.get("spec")),
        generation=(doc.get("metadata") or {}).get("generation"),
        plan=resolved.plan if resolved is not None else None,
        plan_reason=resolved.plan.reason if resolved is not None else error.reason,
        plan_message=resolved.plan.message if resolved is not None else error.message,
        deployment=None,
        previous=None,
        now=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        workload_kind="LeaderWorkerSet" if multinode else "Deployment",
        parallelism=layout.to_status() if multinode else None,
    )


def _status_comment(key: str, status: dict) -> str:
    import yaml

    body = yaml.safe_dump({"status": status}, sort_keys=False).rstrip("\n").splitlines()
    return "\n".join(
        [f"# {key}: the status the operator writes first (before any pod exists)"] + ["# " + line for line in body]
    )


def run(args: argparse.Namespace) -> int:
    import yaml

    from kvserve.cli import manifests
    from kvserve.operator import spec as spec_mod

    docs = manifests.load_documents(args.filename)
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == spec_mod.KIND:
            manifests.check_known_fields(doc, args.filename)
    objs, errors, per_service = render_documents(docs, args.namespace)
    if args.output == "json":
        out: dict = {"apiVersion": "v1", "kind": "List", "items": objs}
        if args.status:
            out["statuses"] = {key: status for key, (_, status) in per_service.items()}
        print(json.dumps(out, indent=2))
    elif args.status:  # each service's manifests, then its status as a comment (kubectl apply ignores it)
        blocks = []
        for key, (children, status) in per_service.items():
            manifests_yaml = yaml.safe_dump_all(children, sort_keys=False) if children else ""
            blocks.append(manifests_yaml + _status_comment(key, status) + "\n")
        print("---\n".join(blocks), end="")
    else:
        print(yaml.safe_dump_all(objs, sort_keys=False), end="")
    for line in errors:
        print(f"error: {line}", file=sys.stderr)
    return 1 if errors else 0

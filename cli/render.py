"""`kvserve render -f FILE.yaml`: the manifests the operator would create, from the same pure renderer."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "Print the Deployment/Service/HPA/PDB the operator would create for InferenceService manifests"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--filename", required=True, help="YAML file with InferenceService(s); - for stdin")
    parser.add_argument("-n", "--namespace", default="default", help="namespace when the manifest sets none")
    parser.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml")
    parser.add_argument("--status", action="store_true", help="also print the planned status as a comment")


def render_documents(docs: list[dict], default_namespace: str) -> tuple[list[dict], list[str]]:
    """(child manifests, error lines) for every InferenceService in `docs`; other kinds are skipped."""
    from kvserve.cli.plan import resolve_like_operator
    from kvserve.operator import render
    from kvserve.operator import spec as spec_mod

    objs: list[dict] = []
    errors: list[str] = []
    for doc in docs:
        if not doc or doc.get("kind") != spec_mod.KIND:
            continue
        meta = doc.get("metadata") or {}
        name, namespace = meta["name"], meta.get("namespace", default_namespace)
        try:
            resolved = resolve_like_operator(doc.get("spec") or {})  # fetches a non-catalog config.json
        except spec_mod.SpecError as exc:
            errors.append(f"{namespace}/{name}: {exc.reason}: {exc.message}")
            continue
        if not resolved.plan.fits:
            errors.append(f"{namespace}/{name}: {resolved.plan.reason}: {resolved.plan.message}")
        objs.extend(render.render(resolved, name, namespace))
    return objs, errors


def run(args: argparse.Namespace) -> int:
    import yaml

    from kvserve.cli import manifests
    from kvserve.operator import spec as spec_mod

    docs = manifests.load_documents(args.filename)
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == spec_mod.KIND:
            manifests.check_known_fields(doc, args.filename)
    objs, errors = render_documents(docs, args.namespace)
    if args.output == "json":
        print(json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}, indent=2))
    else:
        print(yaml.safe_dump_all(objs, sort_keys=False), end="")
    for line in errors:
        print(f"error: {line}", file=sys.stderr)
    return 1 if errors else 0

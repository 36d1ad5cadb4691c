"""Reading InferenceService YAML for `kvserve render` / `kvserve plan -f`: parse errors and unknown fields
become one-line CLIErrors naming the file, line and field, as `kubectl apply` would reject them."""

from __future__ import annotations

import functools
import pathlib
import sys

from kvserve.cli.errors import CLIError

_CRD_NAME = "inferenceservices.serving.kvserve.dev.yaml"


def load_documents(path: str) -> list:
    """Every YAML document in `path` (- for stdin). Raises CLIError for an unreadable file or bad YAML."""
    import yaml

    try:
        text = sys.stdin.read() if path == "-" else pathlib.Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise CLIError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        return list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise CLIError(f"{path}:{where}: invalid YAML: {' '.join(problem.split())}") from exc


@functools.cache
def _spec_schema() -> dict | None:
    """The CRD's spec schema (the repository's crds/ file, the one kubectl applies); None when this install
    does not ship it, and then unknown fields go unchecked here (the API server still rejects them)."""
    import yaml

    root = pathlib.Path(__file__).resolve().parents[1]
    for path in (root / "crds" / _CRD_NAME, root / "charts" / "kvserve" / "crds" / _CRD_NAME):
        if path.is_file():
            crd = yaml.safe_load(path.read_text(encoding="utf-8"))
            return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return None


def unknown_fields(value, schema: dict, prefix: str) -> list[str]:
    """Dotted paths in `value` the structural schema does not declare (what kubectl's strict decoding refuses)."""
    if not isinstance(value, dict) or schema.get("x-kubernetes-preserve-unknown-fields"):
        if isinstance(value, list) and isinstance(schema.get("items"), dict):
            return [p for i, v in enumerate(value) for p in unknown_fields(v, schema["items"], f"{prefix}[{i}]")]
        return []
    props = schema.get("properties")
    if props is None:  # a map (additionalProperties) or a free object: any key
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            return [p for k, v in value.items() for p in unknown_fields(v, extra, f"{prefix}.{k}")]
        return []
    found = []
    for key, sub in value.items():
        if key not in props:
            found.append(f"{prefix}.{key}")
        else:
            found += unknown_fields(sub, props[key], f"{prefix}.{key}")
    return found


def check_known_fields(doc: dict, path: str) -> None:
    """Raises CLIError naming the first unknown spec field of an InferenceService document."""
    schema = _spec_schema()
    if schema is None:
        return
    unknown = unknown_fields(doc.get("spec") or {}, schema, "spec")
    if unknown:
        name = (doc.get("metadata") or {}).get("name", "?")
        known = ", ".join(sorted(schema.get("properties", {}))) if unknown[0].count(".") == 1 else ""
        raise CLIError(f"{path}: {name}: unknown field {unknown[0]!r}" + (f" (spec fields: {known})" if known else ""))

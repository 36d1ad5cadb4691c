"""The CRD's OpenAPI schema checked on a spec the API server has not seen: `kvserve render`, `kvserve plan -f`
and a cluster whose CRD lost its validation. Types, enums, bounds, lengths, patterns and required fields, as
the API server checks them (tests/operator/test_crd_apiserver.py compares the verdicts against a real one);
the CRD's CEL rules are the operator's own checks in spec.py. Unknown fields are the CLI's (cli/manifests).

The schema is read from the repository's crds/ file, the one kubectl applies; an install without it (the
operator's image, where the API server has already validated every object) checks nothing here.
"""

from __future__ import annotations

import functools
import pathlib
import re
from typing import Any

CRD_FILE = "inferenceservices.serving.kvserve.dev.yaml"
_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
}


@functools.cache
def spec_schema() -> dict | None:
    """The CRD's openAPIV3Schema for .spec; None when this install does not ship the CRD."""
    import yaml

    root = pathlib.Path(__file__).resolve().parents[1]
    for path in (root / "crds" / CRD_FILE, root / "charts" / "kvserve" / "crds" / CRD_FILE):
        if path.is_file():
            crd = yaml.safe_load(path.read_text(encoding="utf-8"))
            return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return None


def _type_ok(value: Any, node: dict) -> bool:
    if node.get("x-kubernetes-int-or-string"):
        return isinstance(value, (int, str)) and not isinstance(value, bool)
    kind = node.get("type")
    if kind is None:
        return True
    if isinstance(value, bool) and kind != "boolean":
        return False
    return isinstance(value, _TYPES[kind])


def errors(value: Any, node: dict, where: str) -> list[str]:
    """Every way `value` breaks `node` (an OpenAPI v3 structural schema), each naming its field path."""
    if not _type_ok(value, node):
        return [f"{where} must be of type {node.get('type', 'int-or-string')}, got {value!r}"]
    found = []
    if "enum" in node and value not in node["enum"]:
        found.append(f"{where} must be one of {', '.join(map(str, node['enum']))}, got {value!r}")
    if "minimum" in node and isinstance(value, (int, float)):
        if node.get("exclusiveMinimum") and value <= node["minimum"]:
            found.append(f"{where} must be > {node['minimum']}, got {value!r}")
        elif value < node["minimum"]:
            found.append(f"{where} must be >= {node['minimum']}, got {value!r}")
    if "maximum" in node and isinstance(value, (int, float)) and value > node["maximum"]:
        found.append(f"{where} must be <= {node['maximum']}, got {value!r}")
    if isinstance(value, str):
        if "minLength" in node and len(value) < node["minLength"]:
            found.append(f"{where} must be at least {node['minLength']} characters long")
        if "maxLength" in node and len(value) > node["maxLength"]:
            found.append(f"{where} must be at most {node['maxLength']} characters long")
        if "pattern" in node and not re.search(node["pattern"], value):
            found.append(f"{where} must match {node['pattern']}, got {value!r}")
    if isinstance(value, list):
        if "maxItems" in node and len(value) > node["maxItems"]:
            found.append(f"{where} must have at most {node['maxItems']} items")
        if isinstance(node.get("items"), dict):
            for i, item in enumerate(value):
                found += errors(item, node["items"], f"{where}[{i}]")
    if isinstance(value, dict):
        found += [f"{where}.{key} is required" for key in node.get("required", ()) if key not in value]
        props = node.get("properties") or {}
        extra = node.get("additionalProperties")
        for key, item in value.items():
            if key in props:
                found += errors(item, props[key], f"{where}.{key}")
            elif isinstance(extra, dict):
                found += errors(item, extra, f"{where}.{key}")
    return found


def check(spec: dict) -> list[str]:
    """The schema's verdict on an InferenceService's spec as written: [] when it passes (or no CRD ships)."""
    schema = spec_schema()
    return [] if schema is None else errors(spec, schema, "spec")

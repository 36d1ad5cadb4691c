"""Validate rendered custom resources (KEDA ScaledObject, GIE InferencePool, LeaderWorkerSet) against their
upstream CRDs, vendored in tests/operator/data/upstream_crds/ (source, commit and version in the README there).

Without an API server: the OpenAPI v3 schema (types, enums, required, min/max, patterns, unknown fields
rejected as under `kubectl apply`'s strict field validation) with jsonschema. The CRDs' CEL rules are not
re-stated: the real API server (tests/operator/apiserver.py) installs these CRDs and judges the objects.
LeaderWorkerSet also has a validating webhook (pkg/webhooks/leaderworkerset_webhook.go generalValidate); its
rules that a rendered object can break are re-stated in `_lws_webhook_errors`.
"""

from __future__ import annotations

import functools
import pathlib
import re

import jsonschema
import yaml

DATA = pathlib.Path(__file__).resolve().parent / "data" / "upstream_crds"
FILES = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_scaledobjects.yaml",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inference.networking.k8s.io_inferencepools.yaml",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset.x-k8s.io_leaderworkersets.yaml",
}
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the LWS CRD is 1.3 MB (two pod templates)


def _json_schema(node: dict) -> dict:
    out = {
        k: v
        for k, v in node.items()
        if not k.startswith("x-kubernetes-") and k not in ("properties", "items", "additionalProperties")
    }
    if "properties" in node:
        out["properties"] = {k: _json_schema(v) for k, v in node["properties"].items()}
        if not node.get("x-kubernetes-preserve-unknown-fields") and node.get("additionalProperties") is None:
            out["additionalProperties"] = False
    elif node.get("type") == "object" and not node.get("x-kubernetes-preserve-unknown-fields"):
        if "additionalProperties" not in node:
            out["additionalProperties"] = False  # a structural object without properties holds nothing
    if "items" in node:
        out["items"] = _json_schema(node["items"])
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = _json_schema(node["additionalProperties"])
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
        out.pop("anyOf", None)
    return out


@functools.lru_cache(maxsize=None)
def schema(api_version: str, kind: str) -> dict:
    crd = yaml.load((DATA / FILES[(api_version, kind)]).read_text(), Loader=_LOADER)  # noqa: S506 - a safe loader
    version = api_version.split("/")[1]
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert served["served"], f"{kind} {version} is not served upstream"
    return served["schema"]["openAPIV3Schema"]


def validate(obj: dict) -> None:
    """Raises jsonschema.ValidationError (the OpenAPI schema) or ValueError (the LWS webhook's checks). The CRDs'
    CEL rules are the real API server's to judge: tests/operator/test_crd_apiserver.py creates every rendered
    object there, and the `upstream_admit` fixture asks it about one."""
    node = schema(obj["apiVersion"], obj["kind"])
    body = {k: v for k, v in obj.items() if k != "metadata"}  # metadata is the API server's ObjectMeta
    jsonschema.validate(body, _json_schema({**node, "properties": {**node["properties"], "metadata": {}}}))
    errors = _lws_webhook_errors(obj) if obj["kind"] == "LeaderWorkerSet" else []
    if errors:
        raise ValueError("; ".join(errors))


_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def _lws_webhook_errors(obj: dict) -> list[str]:
    """The LWS validating webhook's checks on create (generalValidate), with the defaults it sees applied."""
    errors = []
    name = obj["metadata"]["name"]
    if not _DNS1035.fullmatch(name) or len(name) > 63:  # its headless Service is named after it
        errors.append(f"metadata.name {name!r} must be a DNS-1035 label")
    spec = obj["spec"]
    replicas, size = spec.get("replicas", 1), spec["leaderWorkerTemplate"].get("size", 1)
    if size < 1:
        errors.append("spec.leaderWorkerTemplate.size must be >= 1")
    if not 0 <= replicas <= 1_000_000 or replicas * size > 2**31 - 1:
        errors.append("spec.replicas out of range")
    rolling = (spec.get("rolloutStrategy") or {}).get("rollingUpdateConfiguration") or {}
    if rolling.get("maxUnavailable", 1) in (0, "0%") and rolling.get("maxSurge", 0) in (0, "0%") and replicas:
        errors.append("spec.rolloutStrategy: maxUnavailable must not be 0 when maxSurge is 0")
    return errors


def crds() -> list[dict]:
    """The vendored CRDs, as files to apply."""
    return [yaml.load((DATA / name).read_text(), Loader=_LOADER) for name in FILES.values()]  # noqa: S506


def plural(api_version: str, kind: str) -> str:
    crd = yaml.load((DATA / FILES[(api_version, kind)]).read_text(), Loader=_LOADER)  # noqa: S506 - a safe loader
    return crd["spec"]["names"]["plural"]


def is_upstream_custom(obj: dict) -> bool:
    return (obj["apiVersion"], obj["kind"]) in FILES

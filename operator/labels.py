"""Every Kubernetes label the operator puts on what it renders, in one place: the engine's and the router's
selectors (what Services, PDBs, HPAs' /scale and NetworkPolicies match), the owner label that routes child
events back to their InferenceService, and managed-by (what the operator watches). Pure."""

from __future__ import annotations

MANAGED_BY = "kvserve-operator"
OWNER_LABEL = "serving.kvserve.dev/inferenceservice"
_SELECTOR_KEYS = ("app.kubernetes.io/name", "app.kubernetes.io/instance")


def engine_selector(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "kvserve", "app.kubernetes.io/instance": name}


def selector_string(name: str) -> str:
    """engine_selector as a label-selector string (the /scale subresource's `selector`)."""
    return ",".join(f"{k}={v}" for k, v in sorted(engine_selector(name).items()))


def engine_labels(name: str) -> dict[str, str]:
    return {
        **engine_selector(name),
        "app.kubernetes.io/component": "engine",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        OWNER_LABEL: name,
    }


def engine_pod_selector(name: str) -> dict[str, str]:
    """The engine pods only (not the router's, which share the instance label)."""
    return {**engine_selector(name), "app.kubernetes.io/component": "engine"}


def router_selector(name: str) -> dict[str, str]:
    """Router pods carry their own app.kubernetes.io/name, so the engine's selectors never match them."""
    return {"app.kubernetes.io/name": "kvserve-router", "app.kubernetes.io/instance": name}


def router_labels(name: str) -> dict[str, str]:
    """The engine's labels minus its selector keys, plus the router's: keeps managed-by and the owner label
    (which routes child events back to this InferenceService)."""
    keep = {k: v for k, v in engine_labels(name).items() if k not in _SELECTOR_KEYS}
    return {**router_selector(name), **keep, "app.kubernetes.io/component": "router"}

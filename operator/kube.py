"""The only module that talks to the Kubernetes API: get, create, merge-patch, delete, status patch.

Apply is compare-then-write: a live object that already contains every field we render (extra fields the
API server defaults are fine) is left alone, so reconciling an unchanged InferenceService sends no writes.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import uuid
from typing import Any

from kvserve.operator.spec import API_VERSION, KIND, PLURAL

log = logging.getLogger("kvserve.operator")

# kind -> (API path prefix, plural) for everything the operator reads or writes.
RESOURCES: dict[str, tuple[str, str]] = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Service": ("/api/v1", "services"),
    "HorizontalPodAutoscaler": ("/apis/autoscaling/v2", "horizontalpodautoscalers"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    # From optional CRDs (KEDA, Gateway API Inference Extension): a cluster without them answers 404.
    "ScaledObject": ("/apis/keda.sh/v1alpha1", "scaledobjects"),
    "InferencePool": ("/apis/inference.networking.k8s.io/v1", "inferencepools"),
    # Replicas of several pods (operator/render/multinode.py), from github.com/kubernetes-sigs/lws.
    "LeaderWorkerSet": ("/apis/leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
    KIND: (f"/apis/{API_VERSION}", PLURAL),
    # Read only: pod statuses for failure reasons, the API-key Secret for its rotation digest.
    "Pod": ("/api/v1", "pods"),
    "Secret": ("/api/v1", "secrets"),
    # The operator's leader-election Lease (operator/leader.py).
    "Lease": ("/apis/coordination.k8s.io/v1", "leases"),
    "Event": ("/api/v1", "events"),
}
CHILD_KINDS = (
    "Deployment",
    "Service",
    "HorizontalPodAutoscaler",
    "PodDisruptionBudget",
    "NetworkPolicy",
    "ScaledObject",
    "InferencePool",
)

# The kinds the handlers watch for events on an InferenceService's children (a deleted or hand-edited child is
# restored at once): every kind of RESOURCES but the parent itself, what the operator only reads or keeps for
# itself (Pods, its Lease, Events) and Secrets (least privilege: it may only get and create them, never watch;
# tests/operator/test_helm_chart.py checks the chart's RBAC).
UNWATCHED_KINDS = (KIND, "Pod", "Secret", "Lease", "Event")
OWNED_KINDS = tuple(kind for kind in RESOURCES if kind not in UNWATCHED_KINDS)


def group_version_plural(kind: str) -> tuple[str, str, str]:
    """(API group, version, plural) of a kind in RESOURCES, as kopf names a resource ("" for the core group)."""
    prefix, plural = RESOURCES[kind]
    parts = prefix.strip("/").split("/")  # ["api", version] or ["apis", group, version]
    return ("", parts[1], plural) if parts[0] == "api" else (parts[1], parts[2], plural)


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


# Children of replicas that span several pods, named <name>-lws and <name>-multinode (render_multinode), looked
# at only while the spec or the last status asks for them.
MULTINODE_KINDS = ("LeaderWorkerSet", "Secret")
OPTIONAL_CRD = {
    "ScaledObject": "KEDA (keda.sh)",
    "InferencePool": "the Gateway API Inference Extension CRDs",
    "LeaderWorkerSet": "LeaderWorkerSet (leaderworkerset.x-k8s.io/v1: kubectl apply --server-side -f "
    "https://github.com/kubernetes-sigs/lws/releases/download/v0.10.0/manifests.yaml)",
}


class MissingCRDError(KubeError):
    """A create answered 404: the cluster does not serve the kind (its optional CRD is not installed)."""

    def __init__(self, message: str):
        super().__init__(404, message)
        self.message = message


_client_lock = threading.Lock()
_client: Any = None


def configure(host: str | None = None) -> None:
    """Build the API client: an explicit host (tests), else in-cluster, else the current kubeconfig."""
    global _client
    import kubernetes

    with _client_lock:
        if host is not None:
            config = kubernetes.client.Configuration()
            config.host = host
        else:
            config = kubernetes.client.Configuration()
            try:
                kubernetes.config.load_incluster_config(client_configuration=config)
            except kubernetes.config.ConfigException:
                kubernetes.config.load_kube_config(client_configuration=config)
        _client = kubernetes.client.ApiClient(config)


def _api() -> Any:
    if _client is None:
        configure()
    return _client


def path(kind: str, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    prefix, plural = RESOURCES[kind]
    out = f"{prefix}/namespaces/{namespace}/{plural}"
    if name:
        out += f"/{name}"
    if subresource:
        out += f"/{subresource}"
    return out


def request(
    method: str,
    url_path: str,
    body: Any = None,
    content_type: str = "application/json",
    query: dict[str, str] | None = None,
) -> dict | None:
    """One API call; returns the decoded JSON body, None on 404, raises KubeError on other failures."""
    api = _api()
    headers = {"Accept": "application/json", "Content-Type": content_type}
    import kubernetes

    try:
        if hasattr(api, "param_serialize"):  # kubernetes >= 37 (the newer OpenAPI generator)
            method_, url, headers, body_, _ = api.param_serialize(
                method=method,
                resource_path=url_path,
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
                query_params=list((query or {}).items()),
            )
            response = api.call_api(method_, url, header_params=headers, body=body_, _request_timeout=30)
            response.read()
        else:  # kubernetes <= 36: what pip picks beside botocore (37 needs python-dateutil >= 3, botocore < 3)
            response = api.call_api(
                url_path,
                method,
                query_params=list((query or {}).items()),
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=30,
            )
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:
            return None
        raise KubeError(exc.status or 0, str(exc.reason)) from exc
    if response.status == 404:
        return None
    if response.status >= 400:
        raise KubeError(response.status, response.data.decode(errors="replace")[:500])
    return json.loads(response.data) if response.data else {}


def get(kind: str, namespace: str, name: str) -> dict | None:
    return request("GET", path(kind, namespace, name))


def list_labelled(kind: str, namespace: str, match_labels: dict[str, str]) -> list[dict]:
    """Objects of `kind` in `namespace` carrying every label in `match_labels` (server-side selector, and
    checked again here so a server that ignores the selector cannot hand us someone else's objects)."""
    selector = ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))
    body = request("GET", path(kind, namespace), query={"labelSelector": selector})
    items = (body or {}).get("items") or []
    return [
        obj
        for obj in items
        if all(((obj.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in match_labels.items())
    ]


def contains(live: Any, desired: Any) -> bool:
    """True when `live` has every field of `desired` with equal values (lists: same length, element-wise)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and contains(live[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(live) == len(desired) and all(map(contains, live, desired))
    return live == desired


def owner_reference(owner: dict) -> dict:
    meta = owner["metadata"]
    return {
        "apiVersion": owner.get("apiVersion", API_VERSION),
        "kind": owner.get("kind", KIND),
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def owned_by(obj: dict, owner: dict) -> bool:
    uid = owner["metadata"]["uid"]
    return any(ref.get("uid") == uid for ref in obj.get("metadata", {}).get("ownerReferences") or [])


def adopt(obj: dict, owner: dict) -> dict:
    return {**obj, "metadata": {**obj["metadata"], "ownerReferences": [owner_reference(owner)]}}


def apply(obj: dict, live: dict | None) -> str:
    """Create or merge-patch `obj`; returns 'created', 'patched' or 'unchanged'."""
    kind, meta = obj["kind"], obj["metadata"]
    if live is None:
        if request("POST", path(kind, meta["namespace"]), obj) is None:  # 404: the kind is not served here
            raise MissingCRDError(
                f"cannot create {kind} {meta['namespace']}/{meta['name']}: {obj['apiVersion']} is not served "
                f"by this cluster; install {OPTIONAL_CRD.get(kind, 'its CRD')}",
            )
        log.info("created %s %s/%s", kind, meta["namespace"], meta["name"])
        return "created"
    if contains(live, obj):
        return "unchanged"
    # Merge patch replaces lists whole (containers, tolerations...), which restores hand-edited entries.
    request(
        "PATCH",
        path(kind, meta["namespace"], meta["name"]),
        {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")},
        content_type="application/merge-patch+json",
    )
    log.info("patched %s %s/%s", kind, meta["namespace"], meta["name"])
    return "patched"


def delete(kind: str, namespace: str, name: str) -> None:
    request("DELETE", path(kind, namespace, name))
    log.info("deleted %s %s/%s", kind, namespace, name)


def post_warning(owner: dict, reason: str, message: str, component: str = "kvserve-operator") -> None:
    """A core/v1 Warning Event on `owner`. Posted directly rather than through kopf.warn: the resync runs
    outside kopf's handler context, and pod failures are found there."""
    meta = owner["metadata"]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "type": "Warning",
        "reason": reason,
        "message": message[:1024],
        # client-go's naming: the object's name plus a unique suffix.
        "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": owner.get("apiVersion", API_VERSION),
            "kind": owner.get("kind", KIND),
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
        },
        "source": {"component": component},
        "reportingComponent": component,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    request("POST", path("Event", meta["namespace"]), event)


def status_patch(live_status: dict, status: dict) -> dict:
    """A merge patch turning live_status into status; kopf's own bookkeeping key is left alone."""
    patch: dict[str, Any] = {}
    for key in set(live_status) | set(status):
        if key == "kopf":
            continue
        if key not in status:
            patch[key] = None
        elif key not in live_status:
            patch[key] = status[key]
        elif isinstance(status[key], dict) and isinstance(live_status[key], dict):
            sub = status_patch(live_status[key], status[key])
            if sub:
                patch[key] = sub
        elif live_status[key] != status[key]:
            patch[key] = status[key]
    return patch


def patch_status(namespace: str, name: str, live_status: dict, status: dict) -> bool:
    patch = status_patch(live_status, status)
    if not patch:
        return False
    request(
        "PATCH", path(KIND, namespace, name, "status"), {"status": patch}, content_type="application/merge-patch+json"
    )
    return True

"""Time to ready of an InferenceService's last replica, from the pod statuses the operator already lists.

What decides how fast a fleet scales out (and back from zero) is how long a new pod takes from creation to
serving: scheduling (node provisioning included), image pull, the model-download init container, then the
runtime's own start-up (its phases are on the pod's /metrics as kvserve:startup_phase_seconds). The kubelet
stamps the pod's Ready condition with the time it turned True, so no scrape is needed:

- timeToReadySeconds: metadata.creationTimestamp -> Ready (everything above);
- startupSeconds: status.startTime (the kubelet accepted the pod: after scheduling) -> Ready.

A pod that crashed and came back reports its latest Ready transition, so restarts count in. Pure: dicts in,
a dict out (the reconcile puts it in status.lastReplicaStartup; with no ready pod the last value stays).
How long the startupProbe lets the runtime's part take before a restart: operator/startup_budget.py.
"""

from __future__ import annotations

import datetime


def _time(value: str | None) -> datetime.datetime | None:
    if not value:
        return None
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def _ready_since(pod: dict) -> datetime.datetime | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready" and cond.get("status") == "True":
            return _time(cond.get("lastTransitionTime"))
    return None


def last_replica_startup(pods: list[dict]) -> dict | None:
    """The most recently ready pod's start-up times, or None when no pod is ready (or none says when)."""
    best: tuple[datetime.datetime, dict] | None = None
    for pod in pods:
        ready = _ready_since(pod)
        if ready is None:
            continue
        entry = {"pod": (pod.get("metadata") or {}).get("name", "?"), "readyTime": ready.strftime("%Y-%m-%dT%H:%M:%SZ")}
        created = _time((pod.get("metadata") or {}).get("creationTimestamp"))
        started = _time((pod.get("status") or {}).get("startTime"))
        for key, since in (("timeToReadySeconds", created), ("startupSeconds", started)):
            if since is not None:
                entry[key] = max(0, round((ready - since).total_seconds()))
        if len(entry) > 2 and (best is None or ready > best[0]):
            best = (ready, entry)
    return None if best is None else best[1]

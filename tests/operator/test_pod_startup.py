"""status.lastReplicaStartup: the newest ready pod's time to ready, from the statuses the kubelet writes."""

from __future__ import annotations

from kvserve.operator.pod_startup import last_replica_startup


def pod(name: str, created: str | None, started: str | None, ready: str | None, status: str = "True") -> dict:
    conditions = [{"type": "PodScheduled", "status": "True", "lastTransitionTime": created}]
    if ready is not None:
        conditions.append({"type": "Ready", "status": status, "lastTransitionTime": ready})
    meta = {"name": name} | ({"creationTimestamp": created} if created else {})
    return {"metadata": meta, "status": {"conditions": conditions} | ({"startTime": started} if started else {})}


def test_the_most_recently_ready_pod_is_reported_with_both_durations():
    pods = [
        pod("old", "2026-01-01T10:00:00Z", "2026-01-01T10:00:05Z", "2026-01-01T10:01:00Z"),
        pod("new", "2026-01-01T11:00:00Z", "2026-01-01T11:00:40Z", "2026-01-01T11:02:10Z"),  # 40 s scheduling
        pod("starting", "2026-01-01T11:05:00Z", "2026-01-01T11:05:01Z", None),
    ]
    assert last_replica_startup(pods) == {
        "pod": "new",
        "readyTime": "2026-01-01T11:02:10Z",
        "timeToReadySeconds": 130,
        "startupSeconds": 90,
    }


def test_no_ready_pod_or_no_timestamps_reports_nothing():
    assert last_replica_startup([]) is None
    assert last_replica_startup([pod("a", "2026-01-01T10:00:00Z", None, "2026-01-01T10:01:00Z", "False")]) is None
    assert last_replica_startup([pod("a", None, None, "2026-01-01T10:01:00Z")]) is None
    only_started = last_replica_startup([pod("a", None, "2026-01-01T10:00:30Z", "2026-01-01T10:01:00Z")])
    assert only_started == {"pod": "a", "readyTime": "2026-01-01T10:01:00Z", "startupSeconds": 30}

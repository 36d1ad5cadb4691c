"""Pod diagnosis from the statuses kubelet and the scheduler write (shapes as in `kubectl get pod -o yaml`)."""

from __future__ import annotations

import pathlib

import pytest
import yaml

from kvserve.operator import pod_health, transitions
from kvserve.operator import spec as spec_mod
from kvserve.operator import status as status_mod

ROOT = pathlib.Path(__file__).resolve().parents[2]


def pod(
    name: str, *containers: dict, conditions: list | None = None, deleting: bool = False, init: list | None = None
) -> dict:
    meta = {"name": name, **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})}
    status: dict = {"phase": "Pending" if conditions else "Running", "containerStatuses": list(containers)}
    if conditions:
        status["conditions"] = conditions
    if init:
        status["initContainerStatuses"] = init
    return {"metadata": meta, "status": status}


def crashloop(exit_code=1, message="", reason="Error", restarts=3) -> dict:
    return {
        "name": "kvserve",
        "ready": False,
        "restartCount": restarts,
        "image": "img",
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}},
        "lastState": {"terminated": {"exitCode": exit_code, "reason": reason, "message": message}},
    }


UNSCHEDULABLE = [
    {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are "
        "available: 3 No preemption victims found for incoming pod.",
    }
]
IMAGE_PULL = {
    "name": "kvserve",
    "ready": False,
    "image": "ghcr.io/kvserve/kvserve-runtime:nope",
    "state": {
        "waiting": {
            "reason": "ImagePullBackOff",
            "message": 'Back-off pulling image "ghcr.io/kvserve/kvserve-runtime:nope"',
        }
    },
}


def test_each_failure_kind_is_recognised_with_its_message():
    f = pod_health.diagnose([pod("p1", crashloop(message="Traceback ... ValueError: bad model dir"))])
    assert f.reason == "CrashLoopBackOff" and "ValueError: bad model dir" in f.message and "p1" in f.message
    assert "exit code 1" in f.message and "restarts: 3" in f.message

    f = pod_health.diagnose([pod("p1", crashloop(exit_code=137, reason="OOMKilled"))])
    assert f.reason == "OOMKilled" and "exit code 137" in f.message

    f = pod_health.diagnose([pod("p1", IMAGE_PULL)])
    assert f.reason == "ImagePullBackOff" and "kvserve-runtime:nope" in f.message
    err = {**IMAGE_PULL, "state": {"waiting": {"reason": "ErrImagePull", "message": "manifest unknown"}}}
    assert pod_health.diagnose([pod("p1", err)]).reason == "ImagePullBackOff"

    f = pod_health.diagnose([pod("p1", conditions=UNSCHEDULABLE)])
    assert f.reason == "Unschedulable" and "Insufficient nvidia.com/gpu" in f.message

    missing = {
        "name": "kvserve",
        "ready": False,
        "state": {"waiting": {"reason": "CreateContainerConfigError", "message": 'secret "llama-key" not found'}},
    }
    f = pod_health.diagnose([pod("p1", missing)])
    assert f.reason == "CreateContainerConfigError" and 'secret "llama-key" not found' in f.message


def test_the_runtime_rejecting_its_plan_is_named_as_such():
    line = "kvserve: plan rejected: --kv-cache-bytes 42949672960 exceeds free GPU memory 38 GiB after weights"
    f = pod_health.diagnose([pod("p1", crashloop(message=line + "\n"))])
    assert f.reason == "RuntimeRejectedPlan" and line in f.message
    # Also while the container is between restarts as plain terminated (not yet CrashLoopBackOff).
    terminated = {
        "name": "kvserve",
        "ready": False,
        "restartCount": 0,
        "state": {"terminated": {"exitCode": 2, "reason": "Error", "message": line}},
    }
    assert pod_health.diagnose([pod("p1", terminated)]).reason == "RuntimeRejectedPlan"


def test_other_startup_failures_carry_the_runtime_s_line():
    line = "kvserve: startup failed: FileNotFoundError: /mnt/models/llama/config.json"
    f = pod_health.diagnose([pod("p1", crashloop(message=line))])
    assert f.reason == "RuntimeStartupFailed" and line in f.message


def test_prefixes_match_the_runtime():
    termination = pytest.importorskip("kvserve.runtime.server.termination")
    assert pod_health.PLAN_REJECTED_PREFIX == termination.PLAN_REJECTED_PREFIX
    assert pod_health.STARTUP_FAILED_PREFIX == termination.STARTUP_FAILED_PREFIX


def test_healthy_leaving_and_loading_pods_are_not_failures():
    ready_after_oom = {**crashloop(reason="OOMKilled"), "ready": True, "state": {"running": {}}}
    loading = {"name": "kvserve", "ready": False, "state": {"running": {"startedAt": "t"}}}
    assert pod_health.diagnose([pod("p1", ready_after_oom), pod("p2", loading)]) is None
    assert pod_health.diagnose([pod("p1", crashloop(), deleting=True)]) is None
    assert pod_health.diagnose([]) is None


def test_the_most_specific_failure_wins_and_ties_go_to_the_first_pod():
    pods = [pod("b", conditions=UNSCHEDULABLE), pod("c", IMAGE_PULL), pod("a", crashloop(reason="OOMKilled"))]
    assert pod_health.diagnose(pods).reason == "OOMKilled"
    assert pod_health.diagnose([pod("z", crashloop()), pod("y", crashloop())]).pod == "y"
    # An init container (e.g. a model download) failing counts the same.
    assert pod_health.diagnose([pod("p", init=[{**crashloop(), "name": "fetch"}])]).message.startswith(
        "pod p container fetch"
    )
    long = pod_health.diagnose([pod("p", crashloop(message="x" * 5000))])
    assert len(long.message) == pod_health.MAX_MESSAGE_CHARS


def _resolved():
    return spec_mod.resolve(yaml.safe_load((ROOT / "examples" / "llama70b.yaml").read_text())["spec"])


def _status(pod_failure=None, conflicts=(), previous=None, deployment=None):
    r = _resolved()
    deployment = (
        deployment
        if deployment is not None
        else {
            "metadata": {"generation": 1},
            "status": {"replicas": 1, "readyReplicas": 0, "updatedReplicas": 1, "observedGeneration": 1},
        }
    )
    return status_mod.compute_status(
        name="llama70b",
        namespace="ml",
        spec=r.spec,
        generation=1,
        plan=r.plan,
        plan_reason=r.plan.reason,
        plan_message=r.plan.message,
        deployment=deployment,
        previous=previous,
        now="2026-01-01T00:00:00Z",
        pod_failure=pod_failure,
        conflicts=conflicts,
    )


def _cond(status, ctype):
    return next(c for c in status["conditions"] if c["type"] == ctype)


def test_a_pod_failure_makes_the_service_degraded_and_not_ready():
    failure = pod_health.diagnose([pod("p1", crashloop(reason="OOMKilled", exit_code=137))])
    s = _status(failure)
    assert (_cond(s, "Degraded")["status"], _cond(s, "Degraded")["reason"]) == ("True", "OOMKilled")
    assert _cond(s, "Degraded")["message"] == failure.message
    assert (_cond(s, "Ready")["status"], _cond(s, "Ready")["reason"]) == ("False", "OOMKilled")
    healthy = _status()
    assert _cond(healthy, "Degraded")["status"] == "False" and _cond(healthy, "Ready")["reason"] == "ReplicasNotReady"


def test_a_child_conflict_reports_no_ready_and_no_url():
    foreign = {
        "metadata": {"generation": 1},
        "status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1, "observedGeneration": 1},
    }
    s = _status(conflicts=("Deployment",), deployment=foreign)
    assert (_cond(s, "ChildConflict")["status"], _cond(s, "ChildConflict")["reason"]) == ("True", "ChildConflict")
    assert "Deployment" in _cond(s, "ChildConflict")["message"]
    assert (_cond(s, "Ready")["status"], _cond(s, "Ready")["reason"]) == ("False", "ChildConflict")
    assert "url" not in s and s["readyReplicas"] == 0  # nothing read from someone else's Deployment
    assert _cond(_status(deployment=foreign), "Ready")["status"] == "True"  # the same Deployment, owned


def test_one_warning_per_transition():
    oom = pod_health.diagnose([pod("p1", crashloop(reason="OOMKilled"))])
    loop = pod_health.diagnose([pod("p1", crashloop())])
    fine = _status()
    degraded = _status(oom, previous=fine)
    assert transitions.warnings(fine, degraded) == [("OOMKilled", oom.message)]
    again = _status(oom, previous=degraded)
    assert transitions.warnings(degraded, again) == []  # the resync recomputes it: no second Event
    other = _status(loop, previous=again)
    assert [r for r, _ in transitions.warnings(again, other)] == ["CrashLoopBackOff"]
    assert transitions.warnings(other, _status(previous=other)) == []  # recovering is not a warning
    conflict = _status(conflicts=("Service",), previous=fine)
    assert [r for r, _ in transitions.warnings(fine, conflict)] == ["ChildConflict"]
    assert transitions.warnings(None, fine) == []

"""Issue 15 end to end against kmock's KubernetesEmulator: pod failures (statuses written as kubelet and the
scheduler would), child conflicts, API-key Secret rotation, and two operator processes under leader election.
"""

from __future__ import annotations

import base64
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml
from kopf.testing import KopfRunner

from kvserve.operator import labels, leader
from kvserve.operator.render import security as render_security

ROOT = pathlib.Path(__file__).resolve().parents[2]
NS, NAME = "default", "llama70b"
RESYNC_S = float(os.environ["KVSERVE_RESYNC_SECONDS"])  # conftest sets 0.5 before the handlers import
pytestmark = pytest.mark.timeout(120)


def _example(**spec_updates) -> dict:
    obj = yaml.safe_load((ROOT / "examples" / "llama70b.yaml").read_text())
    obj["metadata"].update(uid="uid-llama70b", generation=1, resourceVersion="1")
    obj["spec"].update(spec_updates)
    return obj


def _runner() -> KopfRunner:
    return KopfRunner(["run", "--standalone", "--all-namespaces", "-m", "kvserve.operator.handlers"], timeout=30)


def _cr(emulator) -> dict:
    return emulator.get(emulator.CR, NS, NAME) or {}


def _condition(emulator, ctype: str) -> dict:
    return next((c for c in (_cr(emulator).get("status") or {}).get("conditions", []) if c["type"] == ctype), {})


def _warnings(emulator, reason: str) -> list[dict]:
    return [
        r.data
        for r in emulator.requests()
        if r.method == "POST"
        and r.resource is not None
        and r.resource.plural == "events"
        and (r.data or {}).get("type") == "Warning"
        and r.data.get("reason") == reason
    ]


def _merge(emulator, resource: str, name: str, body: dict, subresource: str = "") -> None:
    emulator.call(
        "PATCH", emulator.path(resource, NS, name) + subresource, body, content_type="application/merge-patch+json"
    )


def _pod_statuses():
    """What kubelet and the scheduler write, in the order a doomed rollout shows them."""
    gpu = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available."
    rejected = "kvserve: plan rejected: --kv-cache-bytes 43860000000 exceeds the 38.2 GiB free after weights"

    def crash(reason: str, code: int, message: str) -> dict:
        return {
            "phase": "Running",
            "conditions": [{"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [
                {
                    "name": "kvserve",
                    "ready": False,
                    "restartCount": 4,
                    "image": "img",
                    "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 1m20s"}},
                    "lastState": {"terminated": {"exitCode": code, "reason": reason, "message": message}},
                }
            ],
        }

    return [
        (
            "Unschedulable",
            "Insufficient nvidia.com/gpu",
            {
                "phase": "Pending",
                "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": gpu}],
            },
        ),
        (
            "ImagePullBackOff",
            "kvserve-runtime:typo",
            {
                "phase": "Pending",
                "conditions": [{"type": "PodScheduled", "status": "True"}],
                "containerStatuses": [
                    {
                        "name": "kvserve",
                        "ready": False,
                        "image": "ghcr.io/kvserve/kvserve-runtime:typo",
                        "state": {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}},
                    }
                ],
            },
        ),
        ("RuntimeRejectedPlan", rejected, crash("Error", 2, rejected + "\n")),
        ("OOMKilled", "exit code 137", crash("OOMKilled", 137, "")),
        ("CrashLoopBackOff", "CUDA error: out of memory", crash("Error", 1, "RuntimeError: CUDA error: out of memory")),
    ]


def test_pod_failures_become_degraded_within_a_resync_with_one_event_each(emulator):
    pod_resource = emulator.OTHERS["Pod"]
    with _runner() as runner:
        emulator.call("POST", emulator.path(emulator.CR, NS), _example())
        emulator.wait_for(lambda: emulator.get(emulator.CHILDREN["Deployment"], NS, NAME), what="Deployment")
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{NAME}-7d9f-abcde", "namespace": NS, "labels": labels.engine_labels(NAME)},
            "spec": {},
        }
        emulator.call("POST", emulator.path(pod_resource, NS), pod)
        # An unrelated failing pod in the namespace must not be blamed on this service.
        stranger = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "other", "namespace": NS, "labels": {"app": "other"}},
            "status": _pod_statuses()[3][2],
        }
        emulator.call("POST", emulator.path(pod_resource, NS), stranger)
        time.sleep(4 * RESYNC_S)
        assert _condition(emulator, "Degraded").get("status") == "False"
        for reason, text, status in _pod_statuses():
            written = time.monotonic()
            _merge(emulator, pod_resource, pod["metadata"]["name"], {"status": status})
            emulator.wait_for(
                lambda: _condition(emulator, "Degraded").get("reason") == reason, timeout=10, what=f"Degraded={reason}"
            )
            # The operator does not watch pods: the resync found it (plus the time to write the status).
            assert time.monotonic() - written < RESYNC_S + 3.0
            degraded = _condition(emulator, "Degraded")
            assert degraded["status"] == "True" and text in degraded["message"], degraded
            ready = _condition(emulator, "Ready")
            assert ready["status"] == "False" and ready["reason"] == reason
        time.sleep(4 * RESYNC_S)  # several resyncs of the last state: no repeated Events
        for reason, _, _ in _pod_statuses():
            assert len(_warnings(emulator, reason)) == 1, reason
        # The pod recovers: Degraded clears, and no Event is posted for getting better.
        _merge(
            emulator,
            pod_resource,
            pod["metadata"]["name"],
            {
                "status": {
                    "startTime": "2026-01-01T10:00:05Z",
                    "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T10:03:05Z"}],
                    "containerStatuses": [
                        {"name": "kvserve", "ready": True, "restartCount": 4, "state": {"running": {}}}
                    ],
                }
            },
        )
        emulator.wait_for(lambda: _condition(emulator, "Degraded").get("status") == "False", what="recovered")
        assert _cr(emulator)["status"]["url"]
        # The kubelet's Ready transition time: the last replica's time to ready (operator/pod_startup.py).
        emulator.wait_for(lambda: "lastReplicaStartup" in _cr(emulator)["status"], what="lastReplicaStartup")
        startup = _cr(emulator)["status"]["lastReplicaStartup"]
        assert startup["pod"] == pod["metadata"]["name"] and startup["startupSeconds"] == 180, startup
    assert runner.exception is None and "Traceback" not in runner.output, runner.output[-3000:]


def test_a_foreign_child_is_a_conflict_not_an_adoption(emulator):
    foreign = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": NAME, "namespace": NS, "labels": {"app": "someone-else"}},
        "spec": {"replicas": 1, "template": {"spec": {"containers": [{"name": "x", "image": "nginx"}]}}},
        "status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1},
    }
    dep = emulator.CHILDREN["Deployment"]
    emulator.call("POST", emulator.path(dep, NS), foreign)
    with _runner() as runner:
        emulator.call("POST", emulator.path(emulator.CR, NS), _example())
        emulator.wait_for(lambda: _condition(emulator, "ChildConflict").get("status") == "True", what="conflict")
        time.sleep(4 * RESYNC_S)
        assert "Deployment" in _condition(emulator, "ChildConflict")["message"]
        ready = _condition(emulator, "Ready")
        assert (ready["status"], ready["reason"]) == ("False", "ChildConflict")
        status = _cr(emulator)["status"]
        assert "url" not in status and status["readyReplicas"] == 0
        assert emulator.get(dep, NS, NAME) == foreign  # not adopted, not patched
        assert all(emulator.get(r, NS, NAME) is None for k, r in emulator.CHILDREN.items() if k != "Deployment")
        assert len(_warnings(emulator, "ChildConflict")) == 1
        # The owner of the other Deployment removes it: ours appears and the conflict clears.
        emulator.call("DELETE", emulator.path(dep, NS, NAME))
        emulator.wait_for(
            lambda: (emulator.get(dep, NS, NAME) or {}).get("metadata", {}).get("ownerReferences"),
            what="our own Deployment",
        )
        emulator.wait_for(lambda: _condition(emulator, "ChildConflict").get("status") == "False", what="cleared")
        emulator.wait_for(lambda: _cr(emulator)["status"].get("url"), what="url")
    assert runner.exception is None and "Traceback" not in runner.output, runner.output[-3000:]


def test_the_api_key_comes_from_the_secret_and_rotating_it_rolls_the_pods(emulator):
    secret_resource, dep = emulator.OTHERS["Secret"], emulator.CHILDREN["Deployment"]
    old, new = "old-key-3f9a", "new-key-77c1"

    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    emulator.call(
        "POST",
        emulator.path(secret_resource, NS),
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "llama-key", "namespace": NS, "uid": "s-1"},
            "data": {"token": b64(old)},
        },
    )

    def digest() -> str | None:
        d = emulator.get(dep, NS, NAME)
        return ((d or {}).get("spec", {}).get("template", {}).get("metadata", {}).get("annotations") or {}).get(
            render_security.API_KEY_HASH_ANNOTATION
        )

    with _runner() as runner:
        emulator.call(
            "POST",
            emulator.path(emulator.CR, NS),
            _example(auth={"apiKeySecretRef": {"name": "llama-key", "key": "token"}}),
        )
        first = emulator.wait_for(digest, what="the digest annotation")
        container = emulator.get(dep, NS, NAME)["spec"]["template"]["spec"]["containers"][0]
        assert {
            "name": "KVSERVE_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "llama-key", "key": "token"}},
        } in container["env"]
        _merge(emulator, secret_resource, "llama-key", {"data": {"token": b64(new)}})
        rotated = time.monotonic()
        emulator.wait_for(lambda: digest() not in (None, first), what="a new digest after rotation")
        assert time.monotonic() - rotated < RESYNC_S + 3.0
    assert runner.exception is None and "Traceback" not in runner.output, runner.output[-3000:]
    # Neither key, plain or base64, was ever sent anywhere but the Secret itself.
    for r in emulator.requests():
        if r.resource is not None and r.resource.plural != "secrets" and r.data:
            assert not any(k in str(r.data) for k in (old, new, b64(old), b64(new))), r.url


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_operator(emulator, tmp_path, who: str, lease: leader.LeaseSettings, port: int) -> subprocess.Popen:
    kubeconfig = tmp_path / f"kubeconfig-{who}"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "emu",
                "clusters": [{"name": "emu", "cluster": {"server": emulator.url.rstrip("/")}}],
                "users": [{"name": "emu", "user": {"token": f"token-{who}"}}],  # tells the two apart in the request log
                "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "emu", "namespace": NS}}],
            }
        )
    )
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "KVSERVE_RESYNC_SECONDS": str(RESYNC_S),
        "POD_NAME": f"op-{who}",
        "POD_NAMESPACE": NS,
    }
    env.pop("KUBERNETES_SERVICE_HOST", None)
    log = open(tmp_path / f"operator-{who}.log", "w")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvserve.cli.main",
            "operator",
            "--leader-elect",
            "--lease-name",
            lease.name,
            "--lease-duration",
            str(lease.lease_duration_s),
            "--renew-deadline",
            str(lease.renew_deadline_s),
            "--retry-period",
            str(lease.retry_period_s),
            "--liveness",
            f"http://127.0.0.1:{port}/healthz",
            "--metrics-port",
            "0",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )


def test_two_operators_only_the_leader_writes_and_the_standby_takes_over(emulator, tmp_path):
    lease = leader.LeaseSettings(
        name="kvserve-operator",
        namespace=NS,
        identity="-",
        lease_duration_s=2,
        renew_deadline_s=1.5,
        retry_period_s=0.25,
    )
    lease_path = emulator.path(emulator.OTHERS["Lease"], NS, lease.name)

    def holder() -> str:
        return ((emulator.get(emulator.OTHERS["Lease"], NS, lease.name) or {}).get("spec") or {}).get(
            "holderIdentity", ""
        )

    def writes(token: str) -> list[str]:
        return [
            f"{r.method.value} {r.url.path}"
            for r in emulator.requests()
            if r.method in ("POST", "PUT", "PATCH", "DELETE") and r.headers.get("Authorization") == token
        ]

    port_a, port_b = _free_port(), _free_port()
    a = _start_operator(emulator, tmp_path, "a", lease, port_a)
    procs = [a]
    try:
        emulator.wait_for(lambda: holder().startswith("op-a_"), timeout=40, what="a holds the lease")
        b = _start_operator(emulator, tmp_path, "b", lease, port_b)
        procs.append(b)
        emulator.call("POST", emulator.path(emulator.CR, NS), _example())
        dep = emulator.CHILDREN["Deployment"]
        emulator.wait_for(lambda: emulator.get(dep, NS, NAME), timeout=30, what="the leader's Deployment")
        # b is up and standing by: its liveness endpoint answers while it holds no Lease.
        emulator.wait_for(
            lambda: any(r.headers.get("Authorization") == "Bearer token-b" for r in emulator.requests()),
            timeout=40,
            what="b polling the lease",
        )
        with urllib.request.urlopen(f"http://127.0.0.1:{port_b}/healthz", timeout=5) as resp:
            assert resp.status == 200
        time.sleep(6 * RESYNC_S)  # several resyncs with both running
        assert writes("Bearer token-b") == []  # the standby wrote nothing at all, not even the Lease
        assert any(w.startswith("POST") and "deployments" in w for w in writes("Bearer token-a"))
        assert holder().startswith("op-a_")

        a.send_signal(signal.SIGKILL)  # a crash: no release, b must wait for expiry
        a.wait(10)
        killed = time.monotonic()
        emulator.wait_for(
            lambda: holder().startswith("op-b_"), timeout=lease.takeover_bound_s + 5, what="b takes the lease"
        )
        took_over = time.monotonic() - killed
        assert took_over <= lease.takeover_bound_s + 2.0, took_over  # +2 s: API round trips on a busy 2-core box
        # b now reconciles: a deleted Deployment comes back, written by b.
        emulator.call("DELETE", emulator.path(dep, NS, NAME))
        emulator.wait_for(lambda: emulator.get(dep, NS, NAME), timeout=30, what="b restores the Deployment")
        assert any(w.startswith("POST") and "deployments" in w for w in writes("Bearer token-b"))
        assert all(w.startswith("PATCH") and w.endswith(lease_path) for w in writes("Bearer token-b") if "leases" in w)
        b.send_signal(signal.SIGTERM)  # a clean stop hands the Lease back at once
        assert b.wait(20) == 0, (tmp_path / "operator-b.log").read_text()[-3000:]
        assert holder() == ""
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    print(f"takeover after SIGKILL of the leader: {took_over:.2f} s (bound {lease.takeover_bound_s} s)")

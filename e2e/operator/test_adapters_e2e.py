"""spec.adapters end to end (issue 24 item 5): kopf + the handlers against kmock render the adapters into the
Deployment's pod template (so every replica, restarted or scaled up, loads them), keep them there through a
/scale, add one through a spec patch, and report status.adapters and AdaptersReady from the pods (statuses
written as kubelet would): a failed adapter download is AdapterLoadFailed with one Warning Event, a ready
pod serving them all is "3/3"."""

from __future__ import annotations

import copy
import pathlib

import pytest
import yaml
from kopf.testing import KopfRunner

from kvserve.operator import adapters, labels

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "llama3-8b-lora.yaml").read_text())
NS, NAME = EXAMPLE["metadata"]["namespace"], EXAMPLE["metadata"]["name"]
pytestmark = pytest.mark.timeout(90)


def _operator() -> KopfRunner:
    return KopfRunner(["run", "--standalone", "--all-namespaces", "-m", "kvserve.operator.handlers"], timeout=30)


def _cr(emulator) -> dict:
    return emulator.get(emulator.CR, NS, NAME) or {}


def _condition(emulator, ctype: str) -> dict:
    return next((c for c in (_cr(emulator).get("status") or {}).get("conditions") or [] if c["type"] == ctype), {})


def _template(emulator) -> dict:
    return (emulator.get(emulator.CHILDREN["Deployment"], NS, NAME) or {}).get("spec", {}).get("template") or {}


def _lora_modules(emulator) -> str | None:
    command = ((_template(emulator).get("spec") or {}).get("containers") or [{}])[0].get("command") or []
    return command[command.index("--lora-modules") + 1] if "--lora-modules" in command else None


def _merge(emulator, resource: str, name: str, body: dict, subresource: str = "") -> None:
    emulator.call(
        "PATCH", emulator.path(resource, NS, name) + subresource, body, content_type="application/merge-patch+json"
    )


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


def test_adapters_reach_every_replica_and_the_status(emulator):
    obj = copy.deepcopy(EXAMPLE)
    obj["metadata"].update(uid="uid-lora", generation=1, resourceVersion="1")
    pod_resource = emulator.OTHERS["Pod"]
    expected = "sql=/mnt/adapters/sql,support-chat=/mnt/adapters/support-chat,summarize=/mnt/adapter-claims/summarize"
    with _operator() as runner:
        emulator.call("POST", emulator.path(emulator.CR, NS), obj)
        emulator.wait_for(lambda: _lora_modules(emulator) == expected, what="the adapters in the pod template")
        inits = [c["name"] for c in _template(emulator)["spec"]["initContainers"]]
        assert inits == ["adapter-download-0", "adapter-download-1"]
        annotations = _template(emulator)["metadata"]["annotations"]
        assert annotations[adapters.POD_ANNOTATION] == "sql,support-chat,summarize"
        emulator.wait_for(lambda: _cr(emulator).get("status", {}).get("adapters") == "0/3", what="adapters 0/3")
        assert _condition(emulator, "AdaptersReady")["reason"] == "AdaptersLoading"

        # A pod of that template whose sql download fails (what the init container's termination log says).
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{NAME}-5c7d-aaaaa",
                "namespace": NS,
                "labels": labels.engine_labels(NAME),
                "annotations": dict(annotations),
            },
            "spec": {},
        }
        emulator.call("POST", emulator.path(pod_resource, NS), pod)
        failed = {
            "name": "adapter-download-0",
            "ready": False,
            "restartCount": 2,
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {
                "terminated": {
                    "exitCode": 1,
                    "reason": "Error",
                    "message": "kvserve: download failed: s3://adapters.example/llama3-8b/sql: AccessDenied\n",
                }
            },
        }
        _merge(emulator, pod_resource, pod["metadata"]["name"], {"status": {"initContainerStatuses": [failed]}})
        emulator.wait_for(
            lambda: _condition(emulator, "AdaptersReady").get("reason") == "AdapterLoadFailed", what="AdapterLoadFailed"
        )
        assert "spec.adapters[0]" in _condition(emulator, "AdaptersReady")["message"]
        assert _condition(emulator, "Degraded")["reason"] == "AdapterLoadFailed"
        assert _condition(emulator, "ModelReady")["reason"] == "Mounted"  # the base model is not to blame
        emulator.wait_for(lambda: len(_warnings(emulator, "AdapterLoadFailed")) == 1, what="one Warning Event")

        # Fixed (the Secret's key): the pod becomes ready, serving every adapter its command lists.
        _merge(
            emulator,
            pod_resource,
            pod["metadata"]["name"],
            {
                "status": {
                    "initContainerStatuses": [
                        {"name": "adapter-download-0", "ready": True, "state": {"terminated": {"exitCode": 0}}}
                    ],
                    "conditions": [{"type": "Ready", "status": "True"}],
                    "containerStatuses": [{"name": "kvserve", "ready": True, "state": {"running": {}}}],
                }
            },
        )
        emulator.wait_for(lambda: _cr(emulator)["status"].get("adapters") == "3/3", what="adapters 3/3")
        emulator.wait_for(lambda: _condition(emulator, "AdaptersReady").get("status") == "True", what="served")
        assert len(_warnings(emulator, "AdapterLoadFailed")) == 1  # no Event for getting better, none repeated

        # A scale-up (as the HPA or `kubectl scale` would): more replicas of the same template, adapters and all.
        _merge(emulator, emulator.CR, NAME, {"spec": {"replicas": 4}}, "/scale")
        emulator.wait_for(
            lambda: emulator.get(emulator.CHILDREN["Deployment"], NS, NAME)["spec"]["replicas"] == 4, what="4 replicas"
        )
        assert _lora_modules(emulator) == expected

        # A fourth adapter: the template changes (the pods roll); the old ready pod does not serve it yet.
        added = obj["spec"]["adapters"] + [{"name": "legal", "uri": "hf://org/legal-lora@v1", "rank": 8}]
        _merge(emulator, emulator.CR, NAME, {"metadata": {"generation": 2}, "spec": {"adapters": added}})
        emulator.wait_for(
            lambda: (_lora_modules(emulator) or "").endswith(",legal=/mnt/adapters/legal"), what="the new adapter"
        )
        emulator.wait_for(lambda: _cr(emulator)["status"].get("adapters") == "3/4", what="adapters 3/4")
        assert _condition(emulator, "AdaptersReady")["reason"] == "AdaptersLoading"

        # A duplicate name is refused naming the field; the running Deployment is left serving.
        dup = added + [{"name": "sql", "uri": "s3://adapters.example/other"}]
        _merge(emulator, emulator.CR, NAME, {"metadata": {"generation": 3}, "spec": {"adapters": dup}})
        emulator.wait_for(
            lambda: _condition(emulator, "CapacityPlanned").get("reason") == "InvalidAdapter", what="InvalidAdapter"
        )
        assert (
            "spec.adapters[4].name 'sql' duplicates spec.adapters[0].name"
            in _condition(emulator, "CapacityPlanned")["message"]
        )
        assert (_lora_modules(emulator) or "").endswith(",legal=/mnt/adapters/legal")
    assert runner.exit_code == 0 and runner.exception is None
    assert "Traceback" not in runner.output, runner.output[-3000:]

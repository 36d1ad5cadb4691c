"""Issue 11 end to end: kopf + the handlers against kmock's emulator, and a local hub server on 127.0.0.1 holding
the tiny model as a private repo. A model outside the catalog is planned from its config.json (fetched with the
Secret's token, nothing else fetched); the pod gets the download init container and a read-only cache; the init
container's termination message becomes ModelReady=False (DownloadFailed) and one Event within a resync."""

from __future__ import annotations

import base64
import json
import os
import pathlib
import time

import pytest
from kopf.testing import KopfRunner
from kvserve_testing import STORIES_DIR

from kvserve.operator import labels
from kvserve.operator import spec as spec_mod
from kvserve.runtime.sources import uri as source_uri
from tests.sources.hub_server import HubServer, Repo

ROOT = pathlib.Path(__file__).resolve().parents[2]
STORIES = STORIES_DIR
NS, NAME, REPO_ID, TOKEN = "default", "stories", "kvserve-test/stories260K", "hf_good"
RESYNC_S = float(os.environ["KVSERVE_RESYNC_SECONDS"])
pytestmark = [
    pytest.mark.timeout(120),
]


def _runner() -> KopfRunner:
    return KopfRunner(["run", "--standalone", "--all-namespaces", "-m", "kvserve.operator.handlers"], timeout=30)


def _secret(name: str, data: dict[str, str]) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": NS},
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }


def _isvc(name: str, secret: str) -> dict:
    return {
        "apiVersion": "serving.kvserve.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1},
        "spec": {
            "model": {
                "uri": f"hf://{REPO_ID}",
                "credentials": {"secretRef": {"name": secret}},
                "cache": {"claimName": "model-cache"},
            },
            "gpu": {"product": "l4"},
            "engine": {"maxModelLen": 512},
        },
    }


def _condition(emulator, name: str, ctype: str) -> dict:
    cr = emulator.get(emulator.CR, NS, name) or {}
    return next((c for c in (cr.get("status") or {}).get("conditions", []) if c["type"] == ctype), {})


def _warnings(emulator, reason: str) -> list[dict]:
    return [
        r.data
        for r in emulator.requests()
        if r.method == "POST"
        and r.resource is not None
        and r.resource.plural == "events"
        and (r.data or {}).get("reason") == reason
    ]


def test_planned_from_config_json_downloaded_by_init_container_failures_surface(emulator):
    repo = Repo.from_folder(REPO_ID, str(STORIES), private=True, token=TOKEN)
    with HubServer(repo) as hub, _runner() as runner:
        emulator.call(
            "POST",
            emulator.path(emulator.OTHERS["Secret"], NS),
            _secret("hf", {"HF_TOKEN": TOKEN, "HF_ENDPOINT": hub.url}),
        )
        emulator.call(
            "POST",
            emulator.path(emulator.OTHERS["Secret"], NS),
            _secret("hf-wrong", {"HF_TOKEN": "hf_wrong", "HF_ENDPOINT": hub.url}),
        )
        emulator.call("POST", emulator.path(emulator.CR, NS), _isvc(NAME, "hf"))
        emulator.call("POST", emulator.path(emulator.CR, NS), _isvc("wrong-token", "hf-wrong"))
        dep = emulator.wait_for(lambda: emulator.get(emulator.CHILDREN["Deployment"], NS, NAME), what="Deployment")

        # The plan is the one the real config.json gives; only config.json was fetched, with the token.
        expected = spec_mod.resolve(
            _isvc(NAME, "hf")["spec"], model_config=json.loads((STORIES / "config.json").read_text())
        ).plan
        emulator.wait_for(lambda: (emulator.get(emulator.CR, NS, NAME).get("status") or {}).get("plan"), what="plan")
        status = emulator.get(emulator.CR, NS, NAME)["status"]
        assert status["plan"]["kvBytesPerToken"] == expected.kv_bytes_per_token == 2 * 5 * 4 * 8 * 2
        assert status["plan"]["kvTokens"] == expected.kv_tokens
        assert _condition(emulator, NAME, "CapacityPlanned")["status"] == "True"
        assert {r["path"] for r in hub.log if "Bearer hf_good" == r["authorization"]} == {
            f"/{REPO_ID}/resolve/main/config.json"
        }

        pod_spec = dep["spec"]["template"]["spec"]
        (init,) = pod_spec["initContainers"]
        key = source_uri.cache_key(source_uri.parse(f"hf://{REPO_ID}"))
        model_dir = f"/mnt/model-cache/models/{key}"
        assert init["command"] == ["kvserve", "download", f"hf://{REPO_ID}@main", "--dest", model_dir]
        assert init["envFrom"] == [{"secretRef": {"name": "hf"}}]
        engine = pod_spec["containers"][0]
        assert engine["command"][:3] == ["kvserve", "serve", model_dir] and "envFrom" not in engine
        assert {"name": "model-cache", "mountPath": "/mnt/model-cache", "readOnly": True} in engine["volumeMounts"]
        emulator.wait_for(
            lambda: _condition(emulator, NAME, "ModelReady").get("reason") == "Downloading",
            what="ModelReady=Downloading",
        )

        # The kubelet reports the init container's failure: the operator does not watch pods, the resync finds it.
        message = (
            f"kvserve: download failed: hf://{REPO_ID}@main ({hub.url}): the token was rejected "
            "(check HF_TOKEN in the Secret named by spec.model.credentials.secretRef)"
        )
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{NAME}-abc", "namespace": NS, "labels": labels.engine_labels(NAME)},
            "status": {
                "phase": "Pending",
                "initContainerStatuses": [
                    {
                        "name": "model-download",
                        "ready": False,
                        "restartCount": 2,
                        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                        "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": message + "\n"}},
                    }
                ],
            },
        }
        written = time.monotonic()
        emulator.call("POST", emulator.path(emulator.OTHERS["Pod"], NS), pod)
        emulator.wait_for(
            lambda: _condition(emulator, NAME, "ModelReady").get("reason") == "DownloadFailed",
            timeout=10,
            what="ModelReady=DownloadFailed",
        )
        assert time.monotonic() - written < RESYNC_S + 3.0
        model_ready = _condition(emulator, NAME, "ModelReady")
        assert model_ready["status"] == "False" and "token was rejected" in model_ready["message"]
        assert _condition(emulator, NAME, "Ready")["reason"] == "DownloadFailed"
        time.sleep(4 * RESYNC_S)  # several resyncs later: still one Event
        events = [e for e in _warnings(emulator, "DownloadFailed") if e["involvedObject"]["name"] == NAME]
        assert len(events) == 1 and "token was rejected" in events[0]["message"]

        # The download succeeds on the next try: ModelReady turns True.
        emulator.call(
            "PATCH",
            emulator.path(emulator.OTHERS["Pod"], NS, pod["metadata"]["name"]),
            {
                "status": {
                    "initContainerStatuses": [
                        {
                            "name": "model-download",
                            "ready": True,
                            "restartCount": 3,
                            "state": {"terminated": {"exitCode": 0, "reason": "Completed"}},
                        }
                    ],
                    "containerStatuses": [{"name": "kvserve", "ready": True, "state": {"running": {}}}],
                }
            },
            content_type="application/merge-patch+json",
        )
        emulator.wait_for(
            lambda: _condition(emulator, NAME, "ModelReady").get("status") == "True", what="ModelReady=True"
        )
        assert _condition(emulator, NAME, "ModelReady")["reason"] == "Downloaded"

        # The other service's token is wrong: no plan, no pods, a clear reason, one Event.
        emulator.wait_for(
            lambda: _condition(emulator, "wrong-token", "CapacityPlanned").get("status") == "False",
            what="CapacityPlanned=False",
        )
        planned = _condition(emulator, "wrong-token", "CapacityPlanned")
        assert planned["reason"] == "ModelConfigUnavailable" and "token was rejected" in planned["message"]
        assert "HF_TOKEN" in planned["message"]
        assert emulator.get(emulator.CHILDREN["Deployment"], NS, "wrong-token") is None
        assert (
            len(
                [
                    e
                    for e in _warnings(emulator, "ModelConfigUnavailable")
                    if e["involvedObject"]["name"] == "wrong-token"
                ]
            )
            == 1
        )
    assert runner.exception is None and "Traceback" not in runner.output, runner.output[-3000:]

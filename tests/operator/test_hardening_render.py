"""Issue 15 rendering: API key from a Secret (and its rotation digest), NetworkPolicy, least-privilege pod
fields and default requests. Pure: spec -> manifests."""

from __future__ import annotations

import copy
import pathlib

import kubernetes_validate
import pytest
import yaml

from kvserve.operator import labels, pod_resources, render
from kvserve.operator import spec as spec_mod
from kvserve.operator.render import security as render_security

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S_VERSION = "1.33"


def _doc(**spec_updates) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / "llama70b.yaml").read_text())
    doc["spec"].update(copy.deepcopy(spec_updates))
    return doc


def _render(doc: dict) -> list[dict]:
    return render.render(spec_mod.resolve(doc["spec"]), doc["metadata"]["name"], "ml")


def _by_kind(objs: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objs}


def _container(objs: list[dict]) -> dict:
    return _by_kind(objs)["Deployment"]["spec"]["template"]["spec"]["containers"][0]


AUTH = {"apiKeySecretRef": {"name": "llama-key", "key": "token"}}


def test_api_key_comes_from_the_secret_and_never_from_args():
    objs = _render(_doc(auth=AUTH))
    c = _container(objs)
    assert {"name": "KVSERVE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "llama-key", "key": "token"}}} in c["env"]
    assert not any("api-key" in arg for arg in c["command"]) and "args" not in c
    assert "KVSERVE_API_KEY" not in str(_container(_render(_doc())))  # no auth: no key env at all
    # The env name is the one `kvserve serve` reads (cli/serve.py) when --api-key is absent.
    assert render_security.API_KEY_ENV in (ROOT / "cli" / "serve.py").read_text()


def test_an_api_key_in_extra_args_is_refused_with_a_reason():
    for arg in (["--api-key", "s3cret"], ["--api-key=s3cret"]):
        doc = _doc()
        doc["spec"]["engine"]["extraArgs"] = arg
        with pytest.raises(spec_mod.SpecError) as exc:
            spec_mod.resolve(doc["spec"])
        assert exc.value.reason == "ApiKeyInArgs" and "apiKeySecretRef" in exc.value.message


def _secret(value_b64: str, uid: str = "uid-1") -> dict:
    return {"metadata": {"name": "llama-key", "uid": uid}, "data": {"token": value_b64}}


def test_rotating_the_secret_changes_the_pod_template():
    objs = _render(_doc(auth=AUTH))
    d1 = render_security.secret_digest(_secret("b2xk"), "token")
    d2 = render_security.secret_digest(_secret("bmV3"), "token")
    assert d1 and d2 and d1 != d2
    assert render_security.secret_digest(_secret("b2xk"), "other") is None
    assert render_security.secret_digest(None, "token") is None
    assert render_security.secret_digest(_secret("b2xk", uid="uid-2"), "token") != d1  # salted by the uid
    before, after = (_by_kind(render_security.with_api_key_hash(objs, d))["Deployment"] for d in (d1, d2))
    annotations = before["spec"]["template"]["metadata"]["annotations"]
    assert annotations[render_security.API_KEY_HASH_ANNOTATION] == d1
    assert "b2xk" not in str(before)  # the value itself never lands in the Deployment
    assert before["spec"]["template"] != after["spec"]["template"]  # a template change: the Deployment rolls
    assert annotations["prometheus.io/scrape"] == "true"  # other annotations kept
    # Children without a pod template, and an unknown digest, are left as rendered.
    assert render_security.with_api_key_hash(objs, None) is objs
    assert _by_kind(render_security.with_api_key_hash(objs, d1))["Service"] == _by_kind(objs)["Service"]
    plain = _render(_doc())
    assert render_security.with_api_key_hash(plain, d1) == plain  # no key env: nothing to roll


def test_network_policy_defaults_and_knobs(monkeypatch):
    monkeypatch.delenv("POD_NAMESPACE", raising=False)  # an operator outside a pod: no peer of its own
    objs = _render(_doc())
    policy = _by_kind(objs)["NetworkPolicy"]
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"] == {
        **labels.engine_selector("llama70b"),
        "app.kubernetes.io/component": "engine",
    }
    # The engine pods carry every label the policy selects on.
    pod_labels = _by_kind(objs)["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert spec["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert spec["policyTypes"] == ["Ingress"]
    api, metrics = spec["ingress"]
    assert api == {"from": [{"podSelector": {}}], "ports": [{"protocol": "TCP", "port": 8000}]}
    assert metrics["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]

    gateway = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
    tight = _by_kind(
        _render(
            _doc(
                port=9000,
                networkPolicy={
                    "allowSameNamespace": False,
                    "from": [gateway],
                    "metricsNamespaceSelector": {"matchLabels": {"team": "obs"}},
                },
            )
        )
    )["NetworkPolicy"]
    kubernetes_validate.validate(tight, K8S_VERSION, strict=True)
    api, metrics = tight["spec"]["ingress"]
    # Without the namespace: only this InferenceService's own pods (the router) and the listed gateway.
    assert api["from"] == [{"podSelector": {"matchLabels": {labels.OWNER_LABEL: "llama70b"}}}, gateway]
    assert api["ports"] == [{"protocol": "TCP", "port": 9000}]
    assert metrics["from"] == [{"namespaceSelector": {"matchLabels": {"team": "obs"}}}]
    assert "NetworkPolicy" not in _by_kind(_render(_doc(networkPolicy={"enabled": False})))


def test_network_policy_admits_the_operators_pods_on_the_metrics_port(monkeypatch):
    """The operator scrapes every engine pod's /metrics for PlanDrift: its pods, in its own namespace (the
    downward API's POD_NAMESPACE), reach the engine port through the metrics rule, whatever the spec's peers."""
    monkeypatch.setenv("POD_NAMESPACE", "kvserve-system")
    for doc in (_doc(), _doc(networkPolicy={"allowSameNamespace": False})):
        policy = _by_kind(_render(doc))["NetworkPolicy"]
        kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
        api, metrics = policy["spec"]["ingress"]
        operator = {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kvserve-system"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator"}},
        }
        assert metrics["from"][1:] == [operator] and metrics["ports"] == [{"protocol": "TCP", "port": 8000}]
        assert operator not in api["from"]
    # The chart's operator pods carry that label, and the chart gives the operator POD_NAMESPACE.
    helpers = (ROOT / "charts/kvserve/templates/_helpers.tpl").read_text()
    selector = helpers.split('define "kvserve.selectorLabels"')[1].split("end")[0]
    assert "app.kubernetes.io/component: operator" in selector
    operator_deployment = (ROOT / "charts/kvserve/templates/deployment-operator.yaml").read_text()
    assert "- name: POD_NAMESPACE" in operator_deployment and "fieldPath: metadata.namespace" in operator_deployment
    # Outside a pod the operator does not know its namespace: only the monitoring namespace.
    monkeypatch.setenv("POD_NAMESPACE", " ")
    assert len(_by_kind(_render(_doc()))["NetworkPolicy"]["spec"]["ingress"][1]["from"]) == 1


def test_engine_pods_do_not_mount_a_service_account_token():
    for doc in (_doc(), _doc(serviceAccountName="custom")):
        pod = _by_kind(_render(doc))["Deployment"]["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False


def test_default_requests_are_sized_from_the_plan_and_overridable():
    doc = _doc()
    doc["spec"].pop("resources")
    r = _container(_render(doc))["resources"]
    gib = 1 << 30
    # TP 4: the front process + 4 GPU workers.
    expected_memory = (pod_resources.FRONT_PROCESS_BYTES + 4 * pod_resources.HOST_BYTES_PER_RANK) // (1 << 20)
    assert r["requests"] == {"cpu": "5", "memory": f"{expected_memory}Mi", "nvidia.com/gpu": "4"}
    assert expected_memory * (1 << 20) == 18 * gib
    assert r["limits"] == {"nvidia.com/gpu": "4"}  # no default memory limit (/dev/shm counts against one)
    # Swap preemption reserves host RAM: the runtime's default, or --swap-space.
    doc["spec"]["engine"]["extraArgs"] = ["--preemption-mode", "swap"]
    assert _container(_render(doc))["resources"]["requests"]["memory"] == f"{(18 + 4) * 1024}Mi"
    doc["spec"]["engine"]["extraArgs"] = ["--preemption-mode=swap", "--swap-space", "10GiB"]
    assert _container(_render(doc))["resources"]["requests"]["memory"] == f"{(18 + 10) * 1024}Mi"
    # The user's figures win, key by key.
    doc["spec"]["resources"] = {"requests": {"memory": "64Gi"}}
    assert _container(_render(doc))["resources"]["requests"] == {"cpu": "5", "memory": "64Gi", "nvidia.com/gpu": "4"}


def test_crash_reasons_reach_the_pod_status():
    assert _container(_render(_doc()))["terminationMessagePolicy"] == "FallbackToLogsOnError"

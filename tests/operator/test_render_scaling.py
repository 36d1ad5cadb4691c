"""Scale from zero and the GIE InferencePool: what the operator renders, validated against the upstream
CRDs (KEDA ScaledObject, GIE InferencePool, vendored in tests/operator/data/upstream_crds), and what it
refuses (minReplicas 0 without the router, unknown spec.gateway fields)."""

from __future__ import annotations

import copy
import pathlib
import re

import jsonschema
import pytest
import yaml

from kvserve.operator import labels, render
from kvserve.operator import spec as spec_mod
from kvserve.operator.render import router as render_router
from tests.operator import upstream_crds

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "llama3-8b-scale-to-zero.yaml").read_text())
NAME, NS = EXAMPLE["metadata"]["name"], EXAMPLE["metadata"]["namespace"]


def _render(spec: dict) -> dict[tuple[str, str], dict]:
    objs = render.render(spec_mod.resolve(spec), NAME, NS)
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def test_min_replicas_zero_renders_a_scaled_object_and_no_hpa():
    objs = _render(EXAMPLE["spec"])
    assert not any(kind == "HorizontalPodAutoscaler" for kind, _ in objs)  # KEDA owns the HPA
    so = objs[("ScaledObject", NAME)]
    upstream_crds.validate(so)
    spec = so["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": spec_mod.API_VERSION, "kind": spec_mod.KIND, "name": NAME}
    assert spec["minReplicaCount"] == 0 and spec["maxReplicaCount"] == 4
    assert spec["cooldownPeriod"] == EXAMPLE["spec"]["autoscaling"]["idlePeriodSeconds"]
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == render.DEFAULT_BEHAVIOR
    triggers = {t["name"]: t for t in spec["triggers"]}
    assert set(triggers) == {"held-requests", "queue-depth", "running-requests"}
    assert all(t["type"] == "prometheus" and t["metadata"]["activationThreshold"] == "0" for t in triggers.values())
    held = triggers["held-requests"]["metadata"]["query"]
    assert held.startswith("sum(kvserve_router:held_requests{") and triggers["queue-depth"]["metadata"][
        "threshold"
    ] == str(EXAMPLE["spec"]["autoscaling"]["targetQueueDepth"])
    assert "vllm:num_requests_waiting" in triggers["queue-depth"]["metadata"]["query"]
    # The pod regexes select exactly the Deployment's pods: the router's for the held count, the engine's for
    # the queue -- not each other's, and not those of an InferenceService whose name extends this one.
    router_re = re.search(r'pod=~"([^"]+)"', held).group(1)
    engine_re = re.search(r'pod=~"([^"]+)"', triggers["queue-depth"]["metadata"]["query"]).group(1)
    engine_pod, router_pod = f"{NAME}-7d9f8b6c5d-x2k9q", f"{NAME}-router-5b7c9d8f6-abcde"
    assert re.fullmatch(engine_re, engine_pod) and not re.fullmatch(engine_re, router_pod)
    assert re.fullmatch(router_re, router_pod) and not re.fullmatch(router_re, engine_pod)
    assert not re.fullmatch(engine_re, f"{NAME}-v2-7d9f8b6c5d-x2k9q")
    assert "\\" not in held  # a backslash would be an escape inside PromQL's double-quoted string
    # The router holds requests (and is ready at zero replicas) with the spec's limits.
    command = objs[("Deployment", NAME + "-router")]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--max-held-requests") + 1] == "128"
    assert command[command.index("--hold-timeout") + 1] == "600"


def test_min_replicas_one_keeps_the_hpa_and_the_router_does_not_hold():
    spec = copy.deepcopy(EXAMPLE["spec"])
    spec["autoscaling"]["minReplicas"] = 1
    objs = _render(spec)
    assert objs[("HorizontalPodAutoscaler", NAME)]["spec"]["minReplicas"] == 1
    assert not any(kind == "ScaledObject" for kind, _ in objs)
    command = objs[("Deployment", NAME + "-router")]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--max-held-requests" not in command
    spec["autoscaling"]["enabled"] = False
    spec["autoscaling"]["minReplicas"] = 0  # autoscaling off: minReplicas means nothing
    assert not any(kind in ("ScaledObject", "HorizontalPodAutoscaler") for kind, _ in _render(spec))


def test_defaults_of_the_scale_to_zero_fields():
    spec = copy.deepcopy(EXAMPLE["spec"])
    for key in ("idlePeriodSeconds", "prometheusAddress"):
        del spec["autoscaling"][key]
    del spec["router"]["maxHeldRequests"], spec["router"]["holdTimeoutSeconds"]
    objs = _render(spec)
    so = objs[("ScaledObject", NAME)]
    assert so["spec"]["cooldownPeriod"] == 300
    assert {t["metadata"]["serverAddress"] for t in so["spec"]["triggers"]} == {
        "http://prometheus-operated.monitoring.svc:9090"
    }
    command = objs[("Deployment", NAME + "-router")]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--max-held-requests") + 1] == str(render_router.DEFAULT_MAX_HELD_REQUESTS)


def test_scale_to_zero_without_the_router_is_refused_naming_the_fields(admit):
    spec = copy.deepcopy(EXAMPLE["spec"])
    spec["router"]["enabled"] = False
    with pytest.raises(spec_mod.SpecError) as info:
        spec_mod.resolve(spec)
    assert info.value.reason == "ScaleToZeroNeedsRouter"
    assert "spec.autoscaling.minReplicas 0" in info.value.message and "spec.router.enabled" in info.value.message
    obj = {**copy.deepcopy(EXAMPLE), "spec": spec}
    with pytest.raises(ValueError, match="needs router.enabled"):
        admit(obj)  # the API server refuses it as well (CEL)
    admit(copy.deepcopy(EXAMPLE))  # and admits the example


def test_inference_pool_selects_the_engine_pods_and_keeps_the_picker_ref():
    pool = _render(EXAMPLE["spec"])[("InferencePool", NAME)]
    upstream_crds.validate(pool)
    assert pool["spec"]["selector"]["matchLabels"] == labels.engine_pod_selector(NAME)
    pod_labels = labels.engine_labels(NAME)
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert not pool["spec"]["selector"]["matchLabels"].items() <= labels.router_labels(NAME).items()
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == EXAMPLE["spec"]["gateway"]["inferencePool"]["endpointPickerRef"]
    spec = copy.deepcopy(EXAMPLE["spec"])
    del spec["gateway"]
    assert not any(kind == "InferencePool" for kind, _ in _render(spec))


@pytest.mark.parametrize(
    "gateway,path",
    [
        ({"inferencPool": {}}, "spec.gateway.inferencPool"),
        (
            {"inferencePool": {"endpointPickerRef": {"name": "epp", "port": {"number": 9002}}, "mode": "x"}},
            "spec.gateway.inferencePool.mode",
        ),
        (
            {"inferencePool": {"endpointPickerRef": {"name": "epp", "port": {"number": 9002}, "failMode": "x"}}},
            "spec.gateway.inferencePool.endpointPickerRef.failMode",
        ),
    ],
)
def test_unknown_gateway_fields_are_rejected(gateway, path, admit):
    spec = {**copy.deepcopy(EXAMPLE["spec"]), "gateway": gateway}
    with pytest.raises(spec_mod.SpecError, match=re.escape(path)) as info:
        spec_mod.resolve(spec)
    assert info.value.reason == "InvalidGateway"
    with pytest.raises(ValueError, match="unknown field"):
        admit({**copy.deepcopy(EXAMPLE), "spec": spec})


def test_an_endpoint_picker_service_needs_a_port(admit):
    spec = copy.deepcopy(EXAMPLE["spec"])
    del spec["gateway"]["inferencePool"]["endpointPickerRef"]["port"]
    with pytest.raises(spec_mod.SpecError, match="endpointPickerRef.port.number is required"):
        spec_mod.resolve(spec)
    with pytest.raises(ValueError, match="port is required"):
        admit({**copy.deepcopy(EXAMPLE), "spec": spec})


def test_the_upstream_validator_is_live():
    so = _render(EXAMPLE["spec"])[("ScaledObject", NAME)]
    broken = copy.deepcopy(so)
    broken["spec"]["triggers"][0]["metricTyp"] = "AverageValue"
    with pytest.raises(jsonschema.ValidationError):
        upstream_crds.validate(broken)


def test_the_upstream_cel_rules_are_the_real_servers(upstream_admit):
    """The vendored CRDs' CEL rules, judged by the real API server (no rule re-stated in the tests)."""
    objs = _render(EXAMPLE["spec"])
    so, pool = objs[("ScaledObject", NAME)], objs[("InferencePool", NAME)]
    upstream_admit(so)  # the rendered ones pass
    upstream_admit(pool)
    broken = copy.deepcopy(so)
    broken["spec"]["minReplicaCount"] = 9
    with pytest.raises(ValueError, match="minReplicaCount"):
        upstream_admit(broken)
    broken = copy.deepcopy(pool)
    broken["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8000}]
    with pytest.raises(ValueError, match="unique"):
        upstream_admit(broken)

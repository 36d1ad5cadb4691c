"""spec.slo + spec.workload (issue 25): the operator plans one replica's SLO capacity with the planner's own
function (operator/fleet.plan_replica, which `kvserve plan --slo-*` also uses) and renders the HPA / KEDA
bounds from it; status.fleet reports it; bad fields are refused by name, by the CRD and by the operator."""

from __future__ import annotations

import copy

import pytest

from kvserve.operator import fleet, render
from kvserve.operator import spec as spec_mod
from kvserve.runtime.planner import catalog
from tests.operator import upstream_crds

SPEC = {
    "model": {"uri": "hf://meta-llama/Meta-Llama-3-8B-Instruct", "name": "llama-3-8b"},
    "gpu": {"product": "h100-80gb"},
    "autoscaling": {"enabled": True},
    "slo": {"ttftP90Seconds": 1.0, "tpotP99Seconds": 0.05},
    "workload": {"requestRate": 100, "minRequestRate": 40, "promptLen": 512, "outputLen": 64},
}


def _objs(spec: dict) -> dict[str, dict]:
    return {o["kind"]: o for o in render.render(spec_mod.resolve(spec), "chat", "ns")}


@pytest.fixture()
def _admit(admit):
    """The spec as the real API server stores it (its defaults), through tests/operator/conftest.py admit."""
    return lambda spec: admit(
        {"apiVersion": spec_mod.API_VERSION, "kind": spec_mod.KIND, "metadata": {"name": "chat"}, "spec": spec}
    )


def test_hpa_bounds_come_from_the_planners_function(_admit):
    resolved = spec_mod.resolve(_admit(copy.deepcopy(SPEC))["spec"])
    target = fleet.target_from_spec(SPEC)
    direct = fleet.plan_replica(resolved.plan_input, resolved.plan, "h100-80gb", target)
    assert resolved.fleet == direct and direct.hpa is not None
    h = direct.hpa
    assert h.max_replicas * direct.replica_requests_per_s >= 100 > (h.max_replicas - 1) * direct.replica_requests_per_s
    assert h.min_replicas * direct.replica_requests_per_s >= 40
    # Not spec.autoscaling's defaults (1, 4, 5): the plan decided.
    assert (h.min_replicas, h.max_replicas) != (1, 4)
    hpa = _objs(SPEC)["HorizontalPodAutoscaler"]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (h.min_replicas, h.max_replicas)
    assert hpa["metrics"][0]["pods"]["target"]["averageValue"] == str(h.target_queue_depth)
    status = fleet.fleet_status(direct, fleet.price_source(spec_mod.parse(SPEC)))
    assert status["feasible"] and status["maxReplicas"] == h.max_replicas
    assert status["replicaRequestsPerSecond"] == pytest.approx(direct.replica_requests_per_s, abs=1e-3)
    assert "roofline" in status["stepTimeSource"]
    # What the fleet costs an hour at its bounds: replicas x GPUs per replica x the catalog's GPU-hour price.
    price = catalog.GPUS["h100-80gb"].usd_per_gpu_hour
    assert status["usdPerGpuHour"] == price and "indicative" in status["priceSource"]
    assert status["usdPerHourAtMaxReplicas"] == pytest.approx(h.max_replicas * price, abs=0.01)
    assert status["usdPerHourAtMinReplicas"] == pytest.approx(h.min_replicas * price, abs=0.01)


def test_the_gpu_price_comes_from_the_spec_when_given(_admit):
    spec = copy.deepcopy(SPEC)
    spec["gpu"]["usdPerGpuHour"] = 2.25
    resolved = spec_mod.resolve(_admit(spec)["spec"])
    status = fleet.fleet_status(resolved.fleet, fleet.price_source(resolved.spec))
    h = resolved.fleet.hpa
    assert status["usdPerGpuHour"] == 2.25 and status["priceSource"] == "spec.gpu.usdPerGpuHour"
    assert status["usdPerHourAtMaxReplicas"] == pytest.approx(h.max_replicas * 2.25, abs=0.01)
    # The price only prices the plan: the bounds are the catalog-priced plan's.
    assert h == spec_mod.resolve(copy.deepcopy(SPEC)).fleet.hpa
    for bad in (0, -1, "cheap"):
        spec["gpu"]["usdPerGpuHour"] = bad
        with pytest.raises(spec_mod.SpecError, match=r"spec\.gpu\.usdPerGpuHour") as exc:
            spec_mod.resolve(spec)
        assert exc.value.reason == "InvalidSLO"
        with pytest.raises(Exception, match="usdPerGpuHour|minimum|number"):
            _admit(spec)


def test_keda_bounds_come_from_the_plan_too():
    spec = copy.deepcopy(SPEC)
    spec["autoscaling"] = {"enabled": True, "minReplicas": 0}
    spec["router"] = {"enabled": True}
    so = _objs(spec)["ScaledObject"]
    upstream_crds.validate(so)
    h = spec_mod.resolve(spec).fleet.hpa
    assert so["spec"]["maxReplicaCount"] == h.max_replicas
    queue = {t["name"]: t["metadata"]["threshold"] for t in so["spec"]["triggers"]}
    assert queue["queue-depth"] == queue["held-requests"] == str(h.target_queue_depth)


def test_unreachable_slo_keeps_the_users_bounds_and_says_why():
    spec = copy.deepcopy(SPEC)
    spec["slo"]["ttftP90Seconds"] = 0.001
    spec["autoscaling"] = {"enabled": True, "minReplicas": 2, "maxReplicas": 7}
    resolved = spec_mod.resolve(spec)
    assert resolved.fleet.hpa is None
    hpa = _objs(spec)["HorizontalPodAutoscaler"]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 7)
    status = fleet.fleet_status(resolved.fleet)
    assert not status["feasible"] and "TTFT p90" in status["reason"] and "spec.autoscaling" in status["reason"]


def test_the_users_explicit_bounds_win_over_the_plan(_admit):
    # The issue: the plan sets the HPA's queue-depth target, "the user's explicit target still wins". The CRD
    # does not default the bounds (test_crd), so a written value is told apart from a default.
    planned = spec_mod.resolve(_admit(copy.deepcopy(SPEC))["spec"]).fleet.hpa
    spec = copy.deepcopy(SPEC)
    spec["autoscaling"] = {"enabled": True, "targetQueueDepth": planned.target_queue_depth + 7}
    resolved = spec_mod.resolve(_admit(spec)["spec"])
    assert resolved.autoscaling == {
        "minReplicas": planned.min_replicas,
        "maxReplicas": planned.max_replicas,
        "targetQueueDepth": planned.target_queue_depth + 7,
    }
    hpa = _objs(spec)["HorizontalPodAutoscaler"]["spec"]
    assert hpa["metrics"][0]["pods"]["target"]["averageValue"] == str(planned.target_queue_depth + 7)
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (planned.min_replicas, planned.max_replicas)
    # An explicit minimum above the planned maximum: the planned bound gives way.
    spec["autoscaling"] = {"enabled": True, "minReplicas": planned.max_replicas + 3}
    bounds = spec_mod.resolve(_admit(spec)["spec"]).autoscaling
    assert bounds["minReplicas"] == bounds["maxReplicas"] == planned.max_replicas + 3
    # Without spec.slo an explicit minimum above the default maximum names both fields.
    plain = {k: v for k, v in SPEC.items() if k not in ("slo", "workload")}
    plain["autoscaling"] = {"enabled": True, "minReplicas": 6}
    with pytest.raises(spec_mod.SpecError, match="maxReplicas") as exc:
        spec_mod.resolve(_admit(plain)["spec"])
    assert exc.value.reason == "InvalidAutoscaling" and "minReplicas (6)" in exc.value.message


def test_without_slo_nothing_changes():
    spec = {k: v for k, v in SPEC.items() if k not in ("slo", "workload")}
    assert spec_mod.resolve(spec).fleet is None
    hpa = _objs(spec)["HorizontalPodAutoscaler"]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (1, 4)


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda s: s.pop("workload"), "spec.workload is required with spec.slo"),
        (lambda s: s["workload"].update(requestRate="fast"), "spec.workload.requestRate"),
        (lambda s: s["workload"].update(outputLen="9:2"), "spec.workload.outputLen"),
        (lambda s: s["gpu"].update(product="my-gpu", memoryMiB=81920), "spec.gpu.product"),
    ],
)
def test_the_operator_names_the_bad_field(mutate, field):
    spec = copy.deepcopy(SPEC)
    mutate(spec)
    with pytest.raises(spec_mod.SpecError, match=field.replace(".", r"\.")) as exc:
        spec_mod.resolve(spec)
    assert exc.value.reason == "InvalidSLO"


def test_the_crd_admits_and_refuses_like_the_operator(_admit):
    stored = _admit(copy.deepcopy(SPEC))["spec"]
    assert stored["slo"] == SPEC["slo"] and stored["workload"]["promptLen"] == 512
    ranged = copy.deepcopy(SPEC)
    ranged["workload"]["promptLen"] = "256:1024"
    assert _admit(ranged)["spec"]["workload"]["promptLen"] == "256:1024"
    for bad in ({"ttftP90Seconds": 0, "tpotP99Seconds": 0.1}, {"ttftP90Seconds": 1}):
        spec = copy.deepcopy(SPEC)
        spec["slo"] = bad
        with pytest.raises(Exception, match="ttftP90Seconds|tpotP99Seconds|minimum"):
            _admit(spec)


def test_plan_file_prints_the_operators_fleet_status(tmp_path, capsys):
    import json

    import yaml

    from kvserve.cli.main import main

    doc = {"apiVersion": spec_mod.API_VERSION, "kind": spec_mod.KIND, "metadata": {"name": "chat"}, "spec": SPEC}
    path = tmp_path / "chat.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["plan", "-f", str(path), "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fleet"] == fleet.fleet_status(
        spec_mod.resolve(copy.deepcopy(SPEC)).fleet, fleet.price_source(spec_mod.parse(SPEC))
    )
    assert main(["plan", "-f", str(path)]) == 0
    assert "fleet (spec.slo): feasible True" in capsys.readouterr().out

"""Disaggregated prefill/decode (issue 42 scope 4): spec.disaggregation renders two pools, each planned by the one
planner at its own TP, with llm-d's role labels and vLLM's --kv-transfer-config, the router in P/D mode, an HPA
per pool on its own signal, the transfer port in the NetworkPolicy, and both pools in the status; built-in
kinds validated with kubernetes-validate, LeaderWorkerSet pools against the vendored upstream LWS CRD."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import pathlib

import kubernetes_validate
import pytest
import yaml

from kvserve.cli import router as router_cli
from kvserve.operator import pools as pools_mod
from kvserve.operator import render, status
from kvserve.operator import spec as spec_mod
from kvserve.operator.render import disaggregation as render_pd
from kvserve.operator.render import multinode as render_multinode
from kvserve.runtime.executor import kv_sizing
from kvserve.runtime.planner import catalog, kv_plan
from tests.operator import upstream_crds
from tests.operator.test_capacity_contract import hf_config, runtime_config_from_pod

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "llama70b-disaggregated.yaml").read_text())
NAME, NS = EXAMPLE["metadata"]["name"], EXAMPLE["metadata"]["namespace"]
K8S_VERSION = "1.33"


def _render(spec: dict, name: str = NAME) -> tuple[spec_mod.Resolved, dict[tuple[str, str], dict]]:
    resolved = spec_mod.resolve(copy.deepcopy(spec))
    return resolved, {(o["kind"], o["metadata"]["name"]): o for o in render.render(resolved, name, NS)}


def _validate_all(objs) -> None:
    for obj in objs:
        if upstream_crds.is_upstream_custom(obj):
            upstream_crds.validate(obj)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def _container(template: dict) -> dict:
    (container,) = template["spec"]["containers"]
    return container


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_the_example_renders_two_pools_a_pd_router_and_an_hpa_per_pool():
    resolved, objs = _render(EXAMPLE["spec"])
    assert resolved.plan.fits and resolved.layout is None and resolved.pools is not None
    assert sorted(k for k in objs if k[0] in ("Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget")) == [
        ("Deployment", f"{NAME}-decode"),
        ("Deployment", f"{NAME}-prefill"),
        ("Deployment", f"{NAME}-router"),
        ("HorizontalPodAutoscaler", f"{NAME}-decode"),
        ("HorizontalPodAutoscaler", f"{NAME}-prefill"),
        ("PodDisruptionBudget", f"{NAME}-decode"),
        ("PodDisruptionBudget", f"{NAME}-prefill"),
        ("PodDisruptionBudget", f"{NAME}-router"),
    ]
    assert ("Deployment", NAME) not in objs  # no aggregated pool
    _validate_all(objs.values())
    for role, kv_role, tp in (("prefill", "kv_producer", "4"), ("decode", "kv_consumer", "8")):
        dep = objs[("Deployment", f"{NAME}-{role}")]
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert labels[render_pd.ROLE_LABEL] == role and dep["metadata"]["labels"][render_pd.ROLE_LABEL] == role
        assert _matches(dep["spec"]["selector"]["matchLabels"], labels)
        container = _container(dep["spec"]["template"])
        cmd = container["command"]
        assert json.loads(_flag(cmd, "--kv-transfer-config")) == {"kv_connector": "NixlConnector", "kv_role": kv_role}
        assert _flag(cmd, "--tensor-parallel-size") == tp and container["resources"]["limits"]["nvidia.com/gpu"] == tp
        env = {e["name"]: e for e in container["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == "5600"
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert {"name": "kv-transfer", "containerPort": 5600, "protocol": "TCP"} in container["ports"]
        spread = dep["spec"]["template"]["spec"]["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"]
        assert spread == dep["spec"]["selector"]["matchLabels"]
    prefill, decode = objs[("Deployment", f"{NAME}-prefill")], objs[("Deployment", f"{NAME}-decode")]
    # The two Deployments never select each other's pods.
    assert not _matches(prefill["spec"]["selector"]["matchLabels"], decode["spec"]["template"]["metadata"]["labels"])
    assert not _matches(decode["spec"]["selector"]["matchLabels"], prefill["spec"]["template"]["metadata"]["labels"])
    # The API Service (the router's --service) selects the pods of both pools.
    svc = objs[("Service", NAME)]["spec"]["selector"]
    assert _matches(svc, prefill["spec"]["template"]["metadata"]["labels"])
    assert _matches(svc, decode["spec"]["template"]["metadata"]["labels"])
    # The router: P/D mode, and it may read pods (their role label).
    router = objs[("Deployment", f"{NAME}-router")]
    cmd = _container(router["spec"]["template"])["command"]
    assert cmd[-len(render_pd.router_pd_args(resolved.pools)) :] == render_pd.router_pd_args(resolved.pools)
    # The router's own parser takes the flags: it reads each pod's role from the label of the Service's pods.
    parser = argparse.ArgumentParser(exit_on_error=False)
    router_cli.add_arguments(parser)
    args = parser.parse_args(cmd[2:])
    assert (args.service, args.role_label) == (NAME, render_pd.ROLE_LABEL)
    rules = objs[("Role", f"{NAME}-router")]["rules"]
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]} in rules


def test_each_pool_runs_the_plan_of_the_one_planner_at_its_own_tp(tmp_path):
    resolved, objs = _render(EXAMPLE["spec"])
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(hf_config(catalog.MODELS["llama-3-70b"])))
    plans = set()
    for pool in resolved.pools:
        same = kv_plan.plan(dataclasses.replace(resolved.plan_input, tensor_parallel_size=pool.tensor_parallel_size))
        assert pool.plan == same  # no second formula
        plans.add(pool.plan.kv_cache_bytes_per_gpu)
        cmd = _container(objs[("Deployment", f"{NAME}-{pool.role}")]["spec"]["template"])["command"]
        assert int(_flag(cmd, "--kv-cache-bytes")) == pool.plan.kv_cache_bytes_per_gpu
        # What `kvserve serve` makes of the pod's command (its own parser, --kv-transfer-config included):
        # exactly the planned blocks, and the pool's transfer role.
        config = runtime_config_from_pod(cmd, str(model_dir))
        assert kv_sizing.explicit_num_blocks(config) == pool.plan.num_blocks_per_gpu
        assert config.kv_transfer.kv_role == pool.kv_role
    assert len(plans) == 2  # TP 4 and TP 8 hold different KV per GPU
    assert resolved.plan == resolved.pools.decode.plan


def test_hpas_scale_each_pool_on_its_own_signal():
    resolved, objs = _render(EXAMPLE["spec"])
    pre = objs[("HorizontalPodAutoscaler", f"{NAME}-prefill")]["spec"]
    assert pre["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{NAME}-prefill"}
    assert (pre["minReplicas"], pre["maxReplicas"]) == (1, 6)
    assert [(m["pods"]["metric"]["name"], m["pods"]["target"]["averageValue"]) for m in pre["metrics"]] == [
        (render.METRIC_NAME, "4")
    ]
    dec = objs[("HorizontalPodAutoscaler", f"{NAME}-decode")]["spec"]
    # The decode pool is spec.replicas: its HPA scales the InferenceService's /scale, like the aggregated one.
    assert dec["scaleTargetRef"] == {"apiVersion": spec_mod.API_VERSION, "kind": spec_mod.KIND, "name": NAME}
    assert (dec["minReplicas"], dec["maxReplicas"]) == (2, 8)
    running = int(pools_mod.RUNNING_TARGET_FRACTION * resolved.spec.engine.max_num_seqs)
    assert [(m["pods"]["metric"]["name"], m["pods"]["target"]["averageValue"]) for m in dec["metrics"]] == [
        (render_pd.RUNNING_METRIC, str(running)),
        (render_pd.KV_USAGE_METRIC, "750m"),  # 75 % of a 0..1 gauge
    ]
    # The prefill HPA owns its Deployment's replicas; the decode Deployment follows spec.replicas.
    assert "replicas" not in objs[("Deployment", f"{NAME}-prefill")]["spec"]
    assert objs[("Deployment", f"{NAME}-decode")]["spec"]["replicas"] == EXAMPLE["spec"]["replicas"]
    # status.selector (the /scale's) selects the decode pods that serve, so Pods metrics average over them.
    selector = dict(kv.split("=") for kv in render_pd.scale_selector(NAME).split(","))
    assert _matches(selector, objs[("Deployment", f"{NAME}-decode")]["spec"]["template"]["metadata"]["labels"])
    assert not _matches(selector, objs[("Deployment", f"{NAME}-prefill")]["spec"]["template"]["metadata"]["labels"])


def test_a_pools_resources_apply_to_its_pods_only():
    spec = copy.deepcopy(EXAMPLE["spec"])
    spec["resources"] = {"requests": {"cpu": "2"}}
    spec["disaggregation"]["prefill"]["resources"] = {"requests": {"cpu": "12", "memory": "96Gi"}}
    _, objs = _render(spec)
    pre = _container(objs[("Deployment", f"{NAME}-prefill")]["spec"]["template"])["resources"]
    dec = _container(objs[("Deployment", f"{NAME}-decode")]["spec"]["template"])["resources"]
    assert (pre["requests"]["cpu"], pre["requests"]["memory"]) == ("12", "96Gi")
    assert dec["requests"]["cpu"] == "2"  # spec.resources, the default of a pool that names none
    assert (pre["limits"]["nvidia.com/gpu"], dec["limits"]["nvidia.com/gpu"]) == ("4", "8")


def test_without_pool_autoscaling_the_replicas_are_fixed():
    spec = copy.deepcopy(EXAMPLE["spec"])
    for role in ("prefill", "decode"):
        del spec["disaggregation"][role]["autoscaling"]
    spec["disaggregation"]["prefill"]["replicas"] = 3
    _, objs = _render(spec)
    assert not [k for k in objs if k[0] == "HorizontalPodAutoscaler"]
    assert objs[("Deployment", f"{NAME}-prefill")]["spec"]["replicas"] == 3
    assert objs[("Deployment", f"{NAME}-decode")]["spec"]["replicas"] == spec["replicas"]


def test_the_network_policy_opens_the_transfer_port_between_the_services_pods():
    spec = copy.deepcopy(EXAMPLE["spec"])
    spec["disaggregation"]["transferPort"] = 7000
    _, objs = _render(spec)
    ingress = objs[("NetworkPolicy", NAME)]["spec"]["ingress"]
    (rule,) = [r for r in ingress if {"protocol": "TCP", "port": 7000} in r["ports"]]
    low, high = render_multinode.EPHEMERAL_PORTS
    assert {"protocol": "TCP", "port": low, "endPort": high} in rule["ports"]  # UCX's TCP data connections
    (peer,) = rule["from"]
    for role in ("prefill", "decode"):
        labels = objs[("Deployment", f"{NAME}-{role}")]["spec"]["template"]["metadata"]["labels"]
        assert _matches(peer["podSelector"]["matchLabels"], labels)
        pod = objs[("Deployment", f"{NAME}-{role}")]["spec"]["template"]["spec"]
        assert pod["securityContext"]["sysctls"] == [render_multinode.PORT_RANGE_SYSCTL]  # the range is pinned


PD_405B = {
    "model": {"name": "llama-3.1-405b", "uri": "pvc://models/Llama-3.1-405B-Instruct"},
    "gpu": {"product": "h100-80gb", "tensorParallelSize": 8},
    "engine": {"maxModelLen": 16384, "gpuMemoryUtilization": 0.92},
    "replicas": 1,
    "router": {"enabled": True},
    "disaggregation": {
        "prefill": {"replicas": 1, "autoscaling": {"maxReplicas": 3}},
        "decode": {"autoscaling": {"maxReplicas": 2}},
    },
}


def test_a_pool_that_spans_nodes_is_a_leader_worker_set_valid_upstream():
    resolved, objs = _render(PD_405B, name="big")
    assert all(p.layout.multinode and p.layout.nodes == 2 for p in resolved.pools)
    assert not [k for k in objs if k[0] == "Deployment" and k[1] != "big-router"]
    _validate_all(objs.values())  # the LWS objects against the vendored upstream CRD (+ its webhook's rules)
    assert [k for k in objs if k[0] == "Secret"] == [("Secret", render_multinode.authkey_secret_name("big"))]
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        lws = objs[(render_multinode.KIND, f"big-{role}-lws")]
        assert lws["metadata"]["labels"][render_pd.ROLE_LABEL] == role
        assert lws["metadata"]["labels"]["serving.kvserve.dev/inferenceservice"] == "big"
        assert "replicas" not in lws["spec"]  # autoscaled through the LWS's /scale
        group = lws["spec"]["leaderWorkerTemplate"]
        leader, worker = _container(group["leaderTemplate"]), _container(group["workerTemplate"])
        for c in (leader, worker):
            assert json.loads(_flag(c["command"], "--kv-transfer-config"))["kv_role"] == kv_role
        assert group["leaderTemplate"]["metadata"]["labels"][render_pd.API_LABEL] == "true"
        assert render_pd.API_LABEL not in group["workerTemplate"]["metadata"]["labels"]  # no HTTP on workers
        hpa = objs[("HorizontalPodAutoscaler", f"big-{role}")]["spec"]
        assert hpa["scaleTargetRef"] == render_multinode.scale_target(f"big-{role}")
    ingress = objs[("NetworkPolicy", "big")]["spec"]["ingress"]
    assert render_multinode.group_ingress("big", render_pd.engine_pod_selector("big")) in ingress


def _refusal(spec: dict) -> spec_mod.SpecError:
    with pytest.raises(spec_mod.SpecError) as info:
        spec_mod.resolve(spec)
    return info.value


@pytest.mark.parametrize(
    "mutate,field",
    [
        (lambda s: s["router"].update(enabled=False), "spec.router.enabled"),
        (lambda s: s.update(autoscaling={"enabled": True}), "spec.autoscaling.enabled"),
        (lambda s: s.update(parallelism={"nodes": 2}), "spec.parallelism.nodes"),
        (
            lambda s: s["disaggregation"]["prefill"].update(autoscaling={"minReplicas": 5, "maxReplicas": 2}),
            "spec.disaggregation.prefill.autoscaling.minReplicas 5 must be <= maxReplicas 2",
        ),
        (
            lambda s: s["disaggregation"]["decode"].update(autoscaling={"maxReplicas": 0}),
            "spec.disaggregation.decode.autoscaling.maxReplicas",
        ),
        (
            lambda s: s.update(parallelism={"gpusPerNode": 4}),
            "spec.disaggregation.decode.tensorParallelSize 8 must be <= spec.parallelism.gpusPerNode 4",
        ),
        (lambda s: s["disaggregation"].pop("decode"), "spec.disaggregation.decode is required"),
        (lambda s: s["disaggregation"].update(connector="Mooncake"), "spec.disaggregation.connector"),
        (lambda s: s.update(disaggregation="yes"), "spec.disaggregation must be an object"),
    ],
)
def test_a_bad_disaggregation_is_refused_naming_the_field(mutate, field):
    spec = copy.deepcopy(EXAMPLE["spec"])
    mutate(spec)
    error = _refusal(spec)
    assert field in error.message, error.message
    assert error.reason in ("InvalidDisaggregation", "InvalidSpec")


def test_a_pool_tp_that_does_not_divide_the_heads_is_refused_naming_the_pool():
    shape = {
        "numLayers": 2,
        "numAttentionHeads": 12,
        "numKeyValueHeads": 4,
        "headDim": 64,
        "hiddenSize": 768,
        "numParameters": 50_000_000,
        "maxPositionEmbeddings": 8192,
        "intermediateSize": 2048,
        "vocabSize": 32000,
    }
    spec = {
        "model": {"uri": "pvc://models/m", "shape": shape},
        "gpu": {"product": "l4"},
        "router": {"enabled": True},
        "disaggregation": {"prefill": {"tensorParallelSize": 8}, "decode": {}},
    }
    error = _refusal(spec)
    assert error.reason == "InvalidDisaggregation"
    assert error.message.startswith("spec.disaggregation.prefill.tensorParallelSize 8: ")
    assert "valid for this model: 1, 2, 4" in error.message
    spec["disaggregation"]["prefill"]["tensorParallelSize"] = 4
    resolved = spec_mod.resolve(spec)
    assert [p.tensor_parallel_size for p in resolved.pools] == [4, 1]  # decode: gpu.tensorParallelSize


def test_a_pool_that_does_not_fit_is_reported_by_name_and_renders_nothing():
    spec = copy.deepcopy(EXAMPLE["spec"])
    spec["disaggregation"]["prefill"]["tensorParallelSize"] = 1  # 70B bf16 weights > one 80 GB GPU
    resolved, objs = _render(spec)
    assert not resolved.plan.fits and resolved.plan.message.startswith("spec.disaggregation.prefill: ")
    assert objs == {}


def test_an_aggregated_spec_is_untouched():
    spec = copy.deepcopy(EXAMPLE["spec"])
    del spec["disaggregation"]
    spec["gpu"]["tensorParallelSize"] = 8
    resolved, objs = _render(spec)
    assert resolved.pools is None and ("Deployment", NAME) in objs
    assert not [k for k in objs if k[1].endswith(("-prefill", "-decode"))]


def _status(resolved, prefill_ready: int, decode_ready: int, prefill_desired: int | None = None) -> dict:
    workloads = {
        "prefill": {"spec": {"replicas": prefill_desired or 2}, "status": {"readyReplicas": prefill_ready}},
        "decode": {
            "metadata": {"generation": 1},
            "spec": {"replicas": 2},
            "status": {
                "replicas": 2,
                "readyReplicas": decode_ready,
                "updatedReplicas": 2,
                "observedGeneration": 1,
            },
        },
    }
    return status.compute_status(
        name=NAME,
        namespace=NS,
        spec=resolved.spec,
        generation=1,
        plan=resolved.plan,
        plan_reason=resolved.plan.reason,
        plan_message=resolved.plan.message,
        deployment=workloads["decode"],
        previous=None,
        now="2026-12-05T00:00:00Z",
        pools=status.pools_status(resolved.pools, workloads),
        selector=render_pd.scale_selector(NAME),
    )


def test_the_status_shows_both_pools_and_is_ready_only_when_both_are():
    resolved = spec_mod.resolve(copy.deepcopy(EXAMPLE["spec"]))
    st = _status(resolved, prefill_ready=1, decode_ready=2)
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "PrefillNotReady")
    assert "prefill 1/2" in ready["message"]
    assert st["disaggregation"]["prefill"] == {
        "replicas": 2,
        "readyReplicas": 1,
        "tensorParallelSize": 4,
        "nodes": 1,
        "kvTokens": resolved.pools.prefill.plan.kv_tokens,
    }
    assert st["disaggregation"]["decode"]["readyReplicas"] == 2 and st["readyReplicas"] == 2
    assert st["selector"] == render_pd.scale_selector(NAME)
    st = _status(resolved, prefill_ready=2, decode_ready=2)
    assert next(c for c in st["conditions"] if c["type"] == "Ready")["status"] == "True"
    st = _status(resolved, prefill_ready=2, decode_ready=1)
    assert next(c for c in st["conditions"] if c["type"] == "Ready")["reason"] == "ReplicasNotReady"

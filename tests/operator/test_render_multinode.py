"""Replicas larger than one node (issue 28): the layout choice, the LeaderWorkerSet and the children around it,
validated against the vendored upstream LWS CRD (+ its webhook's rules), and the pods' command lines run
through `kvserve serve`'s own parser and config builder so the planned KV is what each stage allocates."""

from __future__ import annotations

import copy
import json
import pathlib

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvserve.operator import render, status
from kvserve.operator import spec as spec_mod
from kvserve.operator.render import multinode as render_multinode
from kvserve.operator.render import security as render_security
from kvserve.runtime import capacity
from kvserve.runtime.planner import catalog, layout
from tests.operator import upstream_crds
from tests.operator.test_capacity_contract import hf_config, runtime_config_from_pod

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "llama405b-multinode.yaml").read_text())
NAME, NS = EXAMPLE["metadata"]["name"], EXAMPLE["metadata"]["namespace"]
K8S_VERSION = "1.33"


def _render(spec: dict, name: str = NAME) -> tuple[spec_mod.Resolved, dict[str, dict]]:
    resolved = spec_mod.resolve(spec)
    return resolved, {o["kind"]: o for o in render.render(resolved, name, NS)}


def _validate_all(objs) -> None:
    for obj in objs:
        if upstream_crds.is_upstream_custom(obj):
            upstream_crds.validate(obj)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def _containers(lws: dict) -> tuple[dict, dict]:
    group = lws["spec"]["leaderWorkerTemplate"]
    return group["leaderTemplate"]["spec"]["containers"][0], group["workerTemplate"]["spec"]["containers"][0]


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_405b_on_h100_is_one_lws_group_of_two_pods_per_replica():
    resolved, objs = _render(EXAMPLE["spec"])
    assert resolved.plan.fits and resolved.layout.multinode
    assert (resolved.layout.nodes, resolved.layout.tensor_parallel_size, resolved.layout.pipeline_parallel_size) == (
        2,
        8,
        2,
    )
    assert "Deployment" not in objs
    assert list(objs) == [
        "Secret",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "LeaderWorkerSet",
    ]
    _validate_all(objs.values())
    lws = objs["LeaderWorkerSet"]
    assert lws["metadata"]["name"] == "llama405b-lws"  # not <name>: the LWS's own headless Service takes it
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"
    assert "replicas" not in lws["spec"]  # autoscaled: the HPA owns it through the LWS's /scale
    leader, worker = _containers(lws)
    lcmd, wcmd = leader["command"], worker["command"]
    assert _flag(lcmd, "--tensor-parallel-size") == "8" and _flag(lcmd, "--pipeline-parallel-size") == "2"
    assert _flag(lcmd, "--nnodes") == "2" and _flag(lcmd, "--node-rank") == "0"
    assert _flag(lcmd, "--master-addr") == "$(LWS_LEADER_ADDRESS)" and _flag(lcmd, "--master-port") == "29501"
    assert "--headless" not in lcmd
    assert wcmd == [
        a if a != "0" or lcmd[i - 1] != "--node-rank" else "$(LWS_WORKER_INDEX)" for i, a in enumerate(lcmd)
    ] + ["--headless"]  # the same engine flags on every node, only the rank and --headless differ
    assert int(_flag(lcmd, "--kv-cache-bytes")) == resolved.plan.kv_cache_bytes_per_gpu
    # The leader serves: port, probes, metrics annotations. The worker has no server to probe.
    assert leader["readinessProbe"]["httpGet"]["path"] == "/health" and "startupProbe" in leader
    for key in ("ports", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle"):
        assert key not in worker, key
    assert "annotations" not in group["workerTemplate"]["metadata"]
    assert group["leaderTemplate"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    for container in (leader, worker):
        (env,) = [e for e in container["env"] if e["name"] == render_multinode.AUTHKEY_ENV]
        assert env["valueFrom"]["secretKeyRef"] == {"name": "llama405b-multinode", "key": "authkey"}
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    for template in (group["leaderTemplate"], group["workerTemplate"]):
        assert render_multinode.PORT_RANGE_SYSCTL in template["spec"]["securityContext"]["sysctls"]
    assert group["leaderTemplate"]["metadata"]["labels"][render_multinode.ROLE_LABEL] == "leader"
    assert group["workerTemplate"]["metadata"]["labels"][render_multinode.ROLE_LABEL] == "worker"
    secret = objs["Secret"]
    assert secret["metadata"]["name"] == "llama405b-multinode" and "data" not in secret and "stringData" not in secret


def test_children_point_at_the_leaders_and_the_lws_scale():
    _, objs = _render(EXAMPLE["spec"])
    svc = objs["Service"]["spec"]["selector"]
    assert svc[render_multinode.ROLE_LABEL] == "leader" and svc["app.kubernetes.io/instance"] == NAME
    lws = objs["LeaderWorkerSet"]
    leader_labels = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"]
    worker_labels = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]
    assert all(leader_labels.get(k) == v for k, v in svc.items())
    assert not all(worker_labels.get(k) == v for k, v in svc.items())  # no traffic to headless workers
    assert objs["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": "llama405b-lws",
    }
    pdb = objs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"]
    assert all(worker_labels.get(k) == v for k, v in pdb.items())  # every member: any eviction costs a group
    assert all(leader_labels.get(k) == v for k, v in pdb.items())
    # Group members reach each other on the rendezvous, control and pinned ephemeral ports; the API port
    # rules are the one-pod path's.
    ingress = objs["NetworkPolicy"]["spec"]["ingress"]
    group_rule = ingress[-1]
    assert group_rule["ports"] == [
        {"protocol": "TCP", "port": 29501},
        {"protocol": "TCP", "port": 29502},
        {"protocol": "TCP", "port": 32768, "endPort": 60999},
    ]
    peer = group_rule["from"][0]["podSelector"]["matchLabels"]
    assert all(worker_labels.get(k) == v for k, v in peer.items())
    sysctl_low, sysctl_high = map(int, render_multinode.PORT_RANGE_SYSCTL["value"].split())
    assert (sysctl_low, sysctl_high) == (group_rule["ports"][2]["port"], group_rule["ports"][2]["endPort"])


def test_scale_to_zero_and_inference_pool_target_the_lws_and_its_leaders():
    spec = copy.deepcopy(EXAMPLE["spec"])
    spec["autoscaling"]["minReplicas"] = 0
    spec["router"] = {"enabled": True}
    spec["gateway"] = {"inferencePool": {"endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}}
    _, objs = _render(spec)
    assert "HorizontalPodAutoscaler" not in objs
    _validate_all(objs.values())
    so = objs["ScaledObject"]["spec"]
    assert so["scaleTargetRef"]["kind"] == "LeaderWorkerSet" and so["scaleTargetRef"]["name"] == "llama405b-lws"
    import re

    queue = next(t for t in so["triggers"] if t["name"] == "queue-depth")["metadata"]["query"]
    regex = re.search(r'pod=~"([^"]+)"', queue).group(1)
    assert re.fullmatch(regex, "llama405b-lws-0") and re.fullmatch(regex, "llama405b-lws-12")
    assert not re.fullmatch(regex, "llama405b-lws-0-1")  # a worker
    assert not re.fullmatch(regex, "llama405b-router-7d9f8-x2b4q")
    pool = objs["InferencePool"]["spec"]["selector"]["matchLabels"]
    assert pool[render_multinode.ROLE_LABEL] == "leader"


def test_the_validator_catches_a_broken_lws():
    _, objs = _render(EXAMPLE["spec"])
    broken = copy.deepcopy(objs["LeaderWorkerSet"])
    broken["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RecreateGroupOnPodFailure"
    with pytest.raises(jsonschema.ValidationError):
        upstream_crds.validate(broken)
    typo = copy.deepcopy(objs["LeaderWorkerSet"])
    typo["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(jsonschema.ValidationError):
        upstream_crds.validate(typo)
    webhook = copy.deepcopy(objs["LeaderWorkerSet"])
    webhook["metadata"]["name"] = "9lives.lws"
    with pytest.raises(ValueError, match="DNS-1035"):
        upstream_crds.validate(webhook)


def test_pod_commands_build_the_runtime_config_each_stage_allocates_the_planned_kv(tmp_path):
    """Both members' command lines through `kvserve serve`'s parser and build_engine_config (what the pod runs
    before loading weights): same world, their own node rank; each stage's KV from the same --kv-cache-bytes
    gives blocks whose minimum (what the executor uses) is the plan's, and the heaviest stage's weights are
    what the plan charged."""
    from kvserve.runtime.executor import kv_sizing
    from kvserve.runtime.executor.pipeline import stage_engine_config

    shape = catalog.MODELS["llama-3.1-405b"]
    (tmp_path / "config.json").write_text(json.dumps(hf_config(shape)))
    resolved, objs = _render(EXAMPLE["spec"])
    plan = resolved.plan
    leader, worker = _containers(objs["LeaderWorkerSet"])
    env = {"$(LWS_LEADER_ADDRESS)": "llama405b-lws-0.llama405b-lws.default", "$(LWS_WORKER_INDEX)": "1"}
    configs = []
    for command in (leader["command"], worker["command"]):
        expanded = [env.get(a, a) for a in command if a != "--headless"]
        expanded[2] = str(tmp_path)
        configs.append(runtime_config_from_pod(expanded, str(tmp_path)))
    assert [c.parallel.node_rank for c in configs] == [0, 1]
    for config in configs:
        assert (config.tensor_parallel_size, config.pipeline_parallel_size, config.parallel.nnodes) == (8, 2, 2)
        assert config.world_size == 16 and config.parallel.master_port == render_multinode.MASTER_PORT
    config = configs[0]
    blocks = [kv_sizing.explicit_num_blocks(stage_engine_config(config, r)) for r in config.parallel.stage_layers]
    assert min(blocks) == plan.num_blocks_per_gpu
    weights = [
        capacity.stage_weight_bytes_per_rank(shape, "bfloat16", 8, r, s == 0, s == 1)
        for s, r in enumerate(config.parallel.stage_layers)
    ]
    assert max(weights) == plan.weight_bytes_per_gpu
    assert [s.weight_bytes_per_gpu for s in resolved.layout.stages] == weights
    assert sum(s.num_layers for s in resolved.layout.stages) == shape.num_layers
    assert weights[0] + plan.kv_cache_bytes_per_gpu <= plan.memory_budget_bytes_per_gpu
    assert max(weights) + plan.kv_cache_bytes_per_gpu + plan.activation_reserve_bytes + plan.runtime_overhead_bytes <= (
        plan.memory_budget_bytes_per_gpu
    )


def test_a_smaller_pod_is_refused_with_the_layout_that_would_fit():
    spec = copy.deepcopy(EXAMPLE["spec"])
    spec["gpu"]["tensorParallelSize"] = 4
    resolved, objs = _render(spec)
    assert not resolved.plan.fits and resolved.plan.reason == "WeightsDoNotFit" and objs == {}
    assert "set gpu.tensorParallelSize 8" in resolved.plan.message and "TP 8 x PP 2" in resolved.plan.message
    # A model that fits a wider pod is told so (and stays one pod).
    small = {"model": {"name": "llama-3-70b", "uri": "file:///m"}, "gpu": {"product": "a100-80gb"}}
    refused = spec_mod.resolve(small)
    assert not refused.plan.fits and "gpu.tensorParallelSize 2 fits one pod" in refused.plan.message
    assert not refused.layout.multinode


def test_explicit_nodes_and_refusals_name_their_field():
    spec = {
        "model": {"name": "llama-3-70b", "uri": "file:///m"},
        "gpu": {"product": "a100-80gb", "tensorParallelSize": 4},
        "parallelism": {"nodes": 2},
    }
    resolved, objs = _render(spec, name="l70")
    assert resolved.plan.fits and resolved.layout.nodes == 2 and "spec.parallelism.nodes 2" in resolved.layout.reason
    assert objs["LeaderWorkerSet"]["spec"]["replicas"] == 1  # not autoscaled: the operator rolls spec.replicas
    assert _flag(_containers(objs["LeaderWorkerSet"])[0]["command"], "--pipeline-parallel-size") == "2"
    _validate_all(objs.values())
    one = spec_mod.resolve({**spec, "parallelism": {"nodes": 1}})
    assert one.plan.fits and not one.layout.multinode
    with pytest.raises(spec_mod.SpecError, match=r"spec\.parallelism\.nodes 81") as info:
        spec_mod.resolve({**spec, "parallelism": {"nodes": 81}})
    assert info.value.reason == "InvalidParallelism"
    with pytest.raises(spec_mod.SpecError, match=r"exceeds spec\.parallelism\.gpusPerNode 2"):
        spec_mod.resolve({**spec, "parallelism": {"gpusPerNode": 2}})
    lora = copy.deepcopy(spec)
    lora["engine"] = {"extraArgs": ["--enable-lora"]}
    refused = spec_mod.resolve(lora)
    assert not refused.plan.fits and refused.plan.reason == "PipelineParallelUnsupported"
    assert "--enable-lora" in refused.plan.message
    gemma = {
        "model": {"name": "gemma-2-27b", "uri": "file:///m"},
        "gpu": {"product": "l4", "tensorParallelSize": 4},
        "parallelism": {"nodes": 2},
    }
    if "gemma-2-27b" in catalog.MODELS:
        refused = spec_mod.resolve(gemma)
        assert refused.plan.reason == "PipelineParallelUnsupported" and "Gemma2ForCausalLM" in refused.plan.message
    with pytest.raises(spec_mod.SpecError, match="at most 41 characters") as info:
        render.render(resolved, "a" * 42, NS)
    assert info.value.reason == "InvalidName"


def test_user_named_authkey_secret_and_api_key_on_the_leader_only():
    spec = copy.deepcopy(EXAMPLE["spec"])
    spec["parallelism"]["authKeySecretRef"] = {"name": "group-key", "key": "k"}
    spec["auth"] = {"apiKeySecretRef": {"name": "api", "key": "key"}}
    _, objs = _render(spec)
    assert "Secret" not in objs
    leader, worker = _containers(objs["LeaderWorkerSet"])
    for container in (leader, worker):
        (env,) = [e for e in container["env"] if e["name"] == render_multinode.AUTHKEY_ENV]
        assert env["valueFrom"]["secretKeyRef"] == {"name": "group-key", "key": "k"}
    assert any(e["name"] == render_security.API_KEY_ENV for e in leader["env"])
    assert not any(e["name"] == render_security.API_KEY_ENV for e in worker["env"])
    (lws,) = render_security.with_api_key_hash([objs["LeaderWorkerSet"]], "abc123")
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["leaderTemplate"]["metadata"]["annotations"][render_security.API_KEY_HASH_ANNOTATION] == "abc123"
    assert "annotations" not in group["workerTemplate"]["metadata"]


def test_status_reads_the_lws_and_says_what_was_chosen():
    resolved, objs = _render(EXAMPLE["spec"])
    lws = {**objs["LeaderWorkerSet"], "metadata": {**objs["LeaderWorkerSet"]["metadata"], "generation": 3}}
    common = dict(
        name=NAME,
        namespace=NS,
        spec=resolved.spec,
        generation=1,
        plan=resolved.plan,
        plan_reason=resolved.plan.reason,
        plan_message=resolved.plan.message,
        previous=None,
        now="2026-12-03T00:00:00Z",
        workload_kind="LeaderWorkerSet",
        parallelism=resolved.layout.to_status(),
    )
    ready = {**lws, "status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1, "observedGeneration": 3}}
    out = status.compute_status(deployment=ready, **common)
    cond = {c["type"]: c for c in out["conditions"]}
    assert cond["Ready"]["status"] == "True" and out["readyReplicas"] == 1 and out["replicas"] == 1
    assert out["parallelism"]["nodes"] == 2 and out["parallelism"]["gpusPerReplica"] == 16
    assert out["parallelism"]["stageLayers"] == [63, 63] and "fewest stages" in out["parallelism"]["reason"]
    loading = {**lws, "status": {"replicas": 1, "readyReplicas": 0, "updatedReplicas": 1, "observedGeneration": 3}}
    cond = {c["type"]: c for c in status.compute_status(deployment=loading, **common)["conditions"]}
    assert cond["Ready"]["reason"] == "ReplicasNotReady"
    missing = "cannot create LeaderWorkerSet default/llama405b-lws: ... install LeaderWorkerSet (...)"
    out = status.compute_status(deployment=None, missing_crds=(missing,), **common)
    cond = {c["type"]: c for c in out["conditions"]}
    assert cond["Ready"]["reason"] == "LeaderWorkerSetMissing" and "install LeaderWorkerSet" in cond["Ready"]["message"]
    assert cond["Degraded"]["status"] == "True" and cond["Degraded"]["reason"] == "CRDNotInstalled"


def test_mirrored_constants_equal_the_runtimes():
    from kvserve.runtime import config
    from kvserve.runtime.executor import multinode

    assert layout.PIPELINE_ARCHITECTURES is config.PIPELINE_ARCHITECTURES  # one definition (capacity/support.py)
    assert render_multinode.AUTHKEY_ENV == multinode.AUTHKEY_ENV
    assert render_multinode.CONTROL_PORT == render_multinode.MASTER_PORT + 1  # multinode.control_address

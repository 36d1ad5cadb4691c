"""Pure renderer: golden YAML for the examples, upstream-schema validation, and the pod's invariants."""

from __future__ import annotations

import argparse
import copy
import importlib
import os
import pathlib

import kubernetes_validate
import pytest
import yaml

from kvserve.operator import labels, render, startup_budget
from kvserve.operator import spec as spec_mod
from tests.operator import upstream_crds

ROOT = pathlib.Path(__file__).resolve().parents[2]
GOLDEN = pathlib.Path(__file__).resolve().parent / "golden"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
K8S_VERSION = "1.33"  # unhealthyPodEvictionPolicy is GA since 1.31


def _load(path: pathlib.Path) -> dict:
    return yaml.safe_load(path.read_text())


def _render(doc: dict) -> tuple[spec_mod.Resolved, list[dict]]:
    resolved = spec_mod.resolve(doc["spec"])
    return resolved, render.render(resolved, doc["metadata"]["name"], doc["metadata"].get("namespace", "default"))


@pytest.fixture(autouse=True)
def operator_namespace(monkeypatch):
    """The operator's namespace as the chart's downward API gives it: the engine NetworkPolicy admits its pods."""
    monkeypatch.setenv("POD_NAMESPACE", "kvserve-system")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_golden(path):
    _, objs = _render(_load(path))
    text = yaml.safe_dump_all(objs, sort_keys=False)
    golden = GOLDEN / path.name
    if os.environ.get("KVSERVE_UPDATE_GOLDEN"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text(), "render changed; review and regenerate with KVSERVE_UPDATE_GOLDEN=1"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_rendered_objects_validate_against_upstream_schemas(path):
    _, objs = _render(_load(path))
    kinds = {o["kind"] for o in objs}
    assert kinds >= {"Service", "PodDisruptionBudget"} and len(kinds & {"Deployment", "LeaderWorkerSet"}) == 1
    for obj in objs:
        if upstream_crds.is_upstream_custom(obj):  # KEDA, GIE, LeaderWorkerSet: their vendored CRDs
            upstream_crds.validate(obj)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_validation_catches_a_broken_object():
    # The validator is live: a typo'd field in a rendered Deployment fails strict validation.
    _, objs = _render(_load(ROOT / "examples" / "llama70b.yaml"))
    broken = copy.deepcopy(objs[0])
    broken["spec"]["template"]["spec"]["containers"][0]["startupProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_llama70b_pod_is_sized_by_the_plan():
    resolved, objs = _render(_load(ROOT / "examples" / "llama70b.yaml"))
    by_kind = {o["kind"]: o for o in objs}
    dep = by_kind["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    cmd = container["command"]
    plan = resolved.plan
    assert plan.fits
    assert cmd[:3] == ["kvserve", "serve", "/mnt/models/Meta-Llama-3-70B-Instruct"]
    assert int(_flag(cmd, "--kv-cache-bytes")) == plan.kv_cache_bytes_per_gpu
    assert int(_flag(cmd, "--kv-cache-bytes")) <= plan.memory_budget_bytes_per_gpu - plan.weight_bytes_per_gpu
    assert _flag(cmd, "--tensor-parallel-size") == "4"
    assert _flag(cmd, "--max-model-len") == "8192"
    assert _flag(cmd, "--block-size") == "16"
    assert _flag(cmd, "--served-model-name") == "meta-llama/Meta-Llama-3-70B-Instruct"
    assert "--enable-prefix-caching" in cmd and "--no-enable-chunked-prefill" not in cmd
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "4"
    assert pod["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    startup = container["startupProbe"]
    # slow weight loads: the pod's 140 GB at a network volume's speed, and more (operator/startup_budget.py)
    weights_s = 4 * plan.weight_bytes_per_gpu / startup_budget.WEIGHT_READ_BYTES_PER_S
    budget = startup_budget.budget_seconds(resolved.spec, plan)
    assert startup["periodSeconds"] * startup["failureThreshold"] >= budget > 2 * weights_s > 2000
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > int(_flag(cmd, "--drain-timeout"))
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["topologySpreadConstraints"][0]["whenUnsatisfiable"] == "ScheduleAnyway"
    pdb = by_kind["PodDisruptionBudget"]
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    hpa = by_kind["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "serving.kvserve.dev/v1alpha1",
        "kind": "InferenceService",
        "name": "llama70b",
    }
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "5"}
    # Every child selects the same pods the /scale selector names.
    selector = dict(kv.split("=") for kv in labels.selector_string("llama70b").split(","))
    assert dep["spec"]["selector"]["matchLabels"] == selector
    assert by_kind["Service"]["spec"]["selector"] == selector
    assert all(dep["spec"]["template"]["metadata"]["labels"][k] == v for k, v in selector.items())


def test_spec_changes_reach_the_pod_template():
    doc = _load(ROOT / "examples" / "llama70b.yaml")
    _, before = _render(doc)
    doc["spec"]["gpu"]["tensorParallelSize"] = 8
    doc["spec"]["engine"]["enableChunkedPrefill"] = False
    doc["spec"]["engine"]["kvCacheDtype"] = "fp8"
    resolved, after = _render(doc)
    cmd = after[0]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert _flag(cmd, "--tensor-parallel-size") == "8"
    assert _flag(cmd, "--kv-cache-dtype") == "fp8"
    assert _flag(before[0]["spec"]["template"]["spec"]["containers"][0]["command"], "--kv-cache-dtype") == "auto"
    assert "--no-enable-chunked-prefill" in cmd
    assert after[0]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert int(_flag(cmd, "--kv-cache-bytes")) == resolved.plan.kv_cache_bytes_per_gpu
    assert before[0]["spec"]["template"] != after[0]["spec"]["template"]  # a rollout


def test_autoscaling_off_and_pdb_off_drop_those_children():
    doc = _load(ROOT / "examples" / "llama70b.yaml")
    doc["spec"]["autoscaling"]["enabled"] = False
    doc["spec"]["podDisruptionBudget"] = {"enabled": False}
    doc["spec"]["networkPolicy"] = {"enabled": False}
    _, objs = _render(doc)
    assert [o["kind"] for o in objs] == ["Deployment", "Service"]


def test_impossible_spec_renders_nothing():
    doc = _load(ROOT / "examples" / "llama70b.yaml")
    doc["spec"]["gpu"]["tensorParallelSize"] = 1  # 141 GB of weights on one 80 GB GPU
    resolved, objs = _render(doc)
    assert objs == [] and resolved.plan.reason == "WeightsDoNotFit"


def test_custom_model_shape_and_unknown_model():
    shape = {
        "numLayers": 4,
        "numAttentionHeads": 8,
        "numKeyValueHeads": 2,
        "headDim": 64,
        "hiddenSize": 512,
        "intermediateSize": 1024,
        "vocabSize": 32000,
        "numParameters": 50_000_000,
        "maxPositionEmbeddings": 4096,
    }
    spec = {
        "model": {"name": "my-tiny", "shape": shape, "uri": "file:///models/tiny"},
        "gpu": {"product": "l4"},
        "engine": {"maxModelLen": 4096},
    }
    resolved, objs = _render({"metadata": {"name": "tiny"}, "spec": spec})
    assert resolved.plan.kv_bytes_per_token == 2 * 4 * 2 * 64 * 2
    assert objs[0]["spec"]["template"]["spec"]["containers"][0]["command"][2] == "/models/tiny"
    assert "volumes" in objs[0]["spec"]["template"]["spec"]
    with pytest.raises(spec_mod.SpecError) as err:
        spec_mod.resolve({"model": {"name": "my-tiny", "uri": "file:///m"}, "gpu": {"product": "l4"}})
    assert err.value.reason == "UnknownModel" and "numLayers" in err.value.message
    with pytest.raises(spec_mod.SpecError) as err:
        spec_mod.resolve({"model": {"name": "llama-3-8b", "uri": "file:///m"}, "gpu": {"product": "tpu"}})
    assert err.value.reason == "UnknownGPU"
    # A memory override makes any GPU plannable; overrides of a catalog shape apply on top of it.
    r = spec_mod.resolve(
        {
            "model": {"name": "llama-3-8b", "uri": "file:///m", "shape": {"maxPositionEmbeddings": 65536}},
            "gpu": {"product": "tpu", "memoryMiB": 81920, "nodeSelectorProduct": "X"},
            "engine": {"maxModelLen": 65536},
        }
    )
    assert r.plan.fits and r.model.max_position_embeddings == 65536 and r.gpu_product == "X"


# Flags the runtime has promised but `kvserve serve` may not parse yet (none left). Any other unknown flag fails.
PENDING_RUNTIME_FLAGS: set[str] = set()


def test_rendered_flags_parse_with_the_runtime_cli():
    """The pod's command must be accepted by `kvserve serve`."""
    serve = importlib.import_module("kvserve.cli.serve")
    doc = _load(ROOT / "examples" / "llama70b.yaml")
    doc["spec"]["engine"]["enableChunkedPrefill"] = False
    doc["spec"]["engine"]["maxNumBatchedTokens"] = 8192
    doc["spec"]["engine"]["kvCacheDtype"] = "fp8"
    for d in (_load(ROOT / "examples" / "llama70b.yaml"), doc):
        _, objs = _render(d)
        cmd = objs[0]["spec"]["template"]["spec"]["containers"][0]["command"]
        parser = argparse.ArgumentParser(prog="kvserve serve", exit_on_error=False)
        serve.add_arguments(parser)
        args, unknown = parser.parse_known_args(cmd[2:])
        unknown_flags = {u for u in unknown if u.startswith("--")}
        assert unknown_flags <= PENDING_RUNTIME_FLAGS, f"kvserve serve does not accept {unknown_flags}"
        assert args.kv_cache_bytes == int(_flag(cmd, "--kv-cache-bytes"))  # per rank on both sides
        assert args.tensor_parallel_size == int(_flag(cmd, "--tensor-parallel-size")) == 4
        assert args.max_model_len == 8192 and args.port == 8000
        assert args.enable_chunked_prefill == ("--no-enable-chunked-prefill" not in cmd)
        assert args.kv_cache_dtype == ("fp8" if d is doc else "auto")


def _engine_container(objs: list[dict]) -> dict:
    deployment = next(o for o in objs if o["kind"] == "Deployment" and "router" not in o["metadata"]["name"])
    return deployment["spec"]["template"]["spec"]["containers"][0]


def test_pre_stop_sleep_and_drain_fit_in_the_grace_period():
    doc = _load(ROOT / "examples" / "llama70b.yaml")
    resolved, objs = _render(doc)
    c = _engine_container(objs)
    grace = resolved.spec.termination_grace_period_seconds
    assert c["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}  # the default
    assert int(_flag(c["command"], "--drain-timeout")) == grace - 5 - spec_mod.KILL_MARGIN_SECONDS
    doc["spec"]["drain"] = {"preStopSeconds": 20}
    doc["spec"]["terminationGracePeriodSeconds"] = 60
    _, objs = _render(doc)
    c = _engine_container(objs)
    assert c["lifecycle"]["preStop"]["sleep"]["seconds"] == 20 and _flag(c["command"], "--drain-timeout") == "30"
    doc["spec"]["drain"] = {"preStopSeconds": 0}  # off: no lifecycle at all, the drain gets it all
    _, objs = _render(doc)
    c = _engine_container(objs)
    assert "lifecycle" not in c and _flag(c["command"], "--drain-timeout") == "50"


@pytest.mark.parametrize("grace,pre_stop", [(15, 5), (60, 50), (60, 120)])
def test_a_pre_stop_that_leaves_no_drain_is_refused_naming_the_field(grace, pre_stop):
    doc = _load(ROOT / "examples" / "llama70b.yaml")
    doc["spec"]["terminationGracePeriodSeconds"] = grace
    doc["spec"]["drain"] = {"preStopSeconds": pre_stop}
    with pytest.raises(spec_mod.SpecError) as info:
        spec_mod.resolve(doc["spec"])
    assert info.value.reason == "InvalidDrain"
    assert "spec.drain.preStopSeconds" in info.value.message and "terminationGracePeriodSeconds" in info.value.message
    doc["spec"]["drain"] = {"preStopSeconds": grace - spec_mod.KILL_MARGIN_SECONDS - 1}  # the largest that fits
    assert spec_mod.resolve(doc["spec"]).spec.drain.pre_stop_seconds == grace - 11

"""spec.kvCache.offload (issue 41): the engine's tier flags (parsed by the runtime's own EngineArgs parser), the
host tier's bytes in the pod's memory request (one figure, operator/kv_offload.py), the disk tier's volume per
pod, upstream-schema-valid objects, the status / `kvserve plan` entry, and refusals naming the field."""

from __future__ import annotations

import argparse
import json
import math
import pathlib

import kubernetes_validate
import pytest
import yaml

from kvserve.operator import kv_offload, pod_resources, render
from kvserve.operator import spec as spec_mod
from kvserve.runtime import engine_args

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S_VERSION = "1.33"
GiB, MiB = 1 << 30, 1 << 20


def _doc(example: str = "llama3-8b-l4", **spec) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / f"{example}.yaml").read_text())
    doc["spec"].pop("resources", None)  # the operator's default requests, unless a test writes its own
    doc["spec"].update(spec)
    return doc


def _engine_pod(doc: dict) -> tuple[spec_mod.Resolved, list[dict], dict]:
    resolved = spec_mod.resolve(doc["spec"])
    objs = render.render(resolved, doc["metadata"]["name"], "prod")
    for obj in objs:
        if obj["kind"] in ("Deployment", "LeaderWorkerSet") and "router" not in obj["metadata"]["name"]:
            spec = obj["spec"]
            template = spec["template"] if "template" in spec else spec["leaderWorkerTemplate"]["leaderTemplate"]
            return resolved, objs, template["spec"]
    raise AssertionError("no engine workload rendered")


def _flags(command: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    engine_args.EngineArgs.add_cli_args(parser)
    for flag in ("--host", "--port", "--served-model-name", "--drain-timeout"):
        parser.add_argument(flag)
    namespace, _ = parser.parse_known_args(command[3:])
    return namespace


def _request_bytes(pod: dict) -> int:
    return int(pod_resources.quantity_bytes(pod["containers"][0]["resources"]["requests"]["memory"]))


def test_the_host_tier_is_a_flag_and_in_the_memory_request():
    _, _, off = _engine_pod(_doc())
    _, objs, on = _engine_pod(_doc(kvCache={"offload": {"hostSizeGiB": 16}}))
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    assert _flags(on["containers"][0]["command"]).kv_offloading_size == 16.0
    assert _flags(off["containers"][0]["command"]).kv_offloading_size is None
    assert _request_bytes(on) - _request_bytes(off) == 16 * GiB
    assert not [v for v in on["volumes"] if v["name"] == kv_offload.DISK_VOLUME]  # no disk tier, no volume


def test_a_disk_tier_on_an_empty_dir_requests_its_node_disk():
    _, objs, pod = _engine_pod(_doc(kvCache={"offload": {"hostSizeGiB": 4, "disk": {"sizeGiB": 100}}}))
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    (container,) = pod["containers"]
    flags = _flags(container["command"])
    assert (flags.kv_offloading_disk_dir, flags.kv_offloading_disk_size) == (kv_offload.DISK_MOUNT, 100.0)
    (volume,) = [v for v in pod["volumes"] if v["name"] == kv_offload.DISK_VOLUME]
    size = f"{math.ceil(100 * GiB * kv_offload.DISK_HEADROOM / MiB)}Mi"
    assert volume == {"name": kv_offload.DISK_VOLUME, "emptyDir": {"sizeLimit": size}}
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == kv_offload.DISK_VOLUME]
    assert mount == {"name": kv_offload.DISK_VOLUME, "mountPath": kv_offload.DISK_MOUNT}  # writable
    assert container["resources"]["requests"]["ephemeral-storage"] == size


def test_a_disk_tier_on_a_storage_class_is_a_claim_per_pod():
    disk = {"sizeGiB": 50, "storageClassName": "local-nvme"}
    _, objs, pod = _engine_pod(_doc(kvCache={"offload": {"hostSizeGiB": 4, "disk": disk}}))
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    (volume,) = [v for v in pod["volumes"] if v["name"] == kv_offload.DISK_VOLUME]
    claim = volume["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim["storageClassName"] == "local-nvme" and claim["accessModes"] == ["ReadWriteOnce"]
    assert claim["resources"]["requests"]["storage"] == f"{math.ceil(50 * GiB * kv_offload.DISK_HEADROOM / MiB)}Mi"
    assert "ephemeral-storage" not in pod["containers"][0]["resources"]["requests"]


def test_a_remote_tier_is_the_flag_and_costs_the_pod_nothing_more():
    url = "redis://kv-cache.cache.svc:6379/0"
    _, _, host_only = _engine_pod(_doc(kvCache={"offload": {"hostSizeGiB": 4}}))
    _, objs, pod = _engine_pod(_doc(kvCache={"offload": {"hostSizeGiB": 4, "remoteUrl": url}}))
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    assert _flags(pod["containers"][0]["command"]).kv_offloading_remote_url == url
    assert _flags(host_only["containers"][0]["command"]).kv_offloading_remote_url is None
    assert _request_bytes(pod) == _request_bytes(host_only)
    assert not [v for v in pod["volumes"] if v["name"] == kv_offload.DISK_VOLUME]
    with pytest.raises(spec_mod.SpecError, match="remoteUrl"):
        spec_mod.resolve(_doc(kvCache={"offload": {"hostSizeGiB": 4, "remoteUrl": "http://x:6379"}})["spec"])


def test_a_multi_pod_replica_counts_each_pods_share():
    _, _, off = _engine_pod(_doc("llama405b-multinode"))
    resolved, _, on = _engine_pod(_doc("llama405b-multinode", kvCache={"offload": {"hostSizeGiB": 64}}))
    assert resolved.layout.multinode
    assert _request_bytes(on) - _request_bytes(off) == 64 * GiB // resolved.layout.nodes
    assert kv_offload.status(resolved.spec, resolved.layout.nodes)["hostBytesPerPod"] == 64 * GiB // 2


def test_the_flag_in_extra_args_is_counted_too():
    """Like --swap-space: a tier given as a flag still reaches the memory request."""
    _, _, off = _engine_pod(_doc())
    _, _, on = _engine_pod(_doc(engine={"extraArgs": ["--kv-offloading-size=8"]}))
    assert _request_bytes(on) - _request_bytes(off) == 8 * GiB


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (
            {
                "kvCache": {"offload": {"hostSizeGiB": 4, "disk": {"sizeGiB": 10}}},
                "gpu": {"product": "l4", "tensorParallelSize": 2},
            },
            "spec.kvCache.offload.disk runs with one GPU rank only",
        ),
        (
            {"kvCache": {"offload": {"hostSizeGiB": 4}}, "engine": {"enablePrefixCaching": False}},
            "needs spec.engine.enablePrefixCaching",
        ),
        (
            {"kvCache": {"offload": {"hostSizeGiB": 4}}, "engine": {"extraArgs": ["--kv-offloading-size", "8"]}},
            "spec.engine.extraArgs carries --kv-offloading-size",
        ),
        (
            {"kvCache": {"offload": {"hostSizeGiB": 16}}, "resources": {"requests": {"memory": "12Gi"}}},
            "spec.resources.requests.memory (12Gi) is below the 16 GiB",
        ),
        (
            {"kvCache": {"offload": {"hostSizeGiB": 16}}, "resources": {"limits": {"memory": "16G"}}},
            "spec.resources.limits.memory (16G)",
        ),
    ],
)
def test_a_spec_the_runtime_or_the_kubelet_would_break_on_is_refused_naming_the_field(spec, words):
    doc = _doc(**spec)
    with pytest.raises(spec_mod.SpecError) as err:
        spec_mod.resolve(doc["spec"])
    assert err.value.reason == "InvalidKVCacheOffload" and words in err.value.message, err.value.message


def test_a_sliding_window_model_is_refused():
    doc = _doc()
    doc["spec"]["model"] = {"name": "gemma-2-2b", "uri": "pvc://models/gemma-2-2b"}
    doc["spec"]["kvCache"] = {"offload": {"hostSizeGiB": 4}}
    with pytest.raises(spec_mod.SpecError, match="sliding-window layers"):
        spec_mod.resolve(doc["spec"])


def test_a_memory_figure_that_holds_the_tier_is_the_users():
    doc = _doc(kvCache={"offload": {"hostSizeGiB": 16}}, resources={"requests": {"memory": "40Gi"}})
    _, _, pod = _engine_pod(doc)
    assert pod["containers"][0]["resources"]["requests"]["memory"] == "40Gi"


@pytest.mark.parametrize(
    ("text", "value"),
    [("16Gi", 16 * GiB), ("500M", 500e6), ("1e9", 1e9), (1024, 1024), ("1.5Ki", 1536), ("100m", 0.1), ("x", None)],
)
def test_quantities(text, value):
    assert pod_resources.quantity_bytes(text) == value


def test_status_and_plan_line():
    resolved = spec_mod.resolve(_doc(kvCache={"offload": {"hostSizeGiB": 16, "disk": {"sizeGiB": 100}}})["spec"])
    entry = kv_offload.status(resolved.spec)
    assert entry == {
        "hostBytesPerReplica": 16 * GiB,
        "hostBytesPerPod": 16 * GiB,
        "diskBytes": 100 * GiB,
        "diskVolume": "emptyDir",
    }
    assert kv_offload.describe(entry) == (
        "kv offload (spec.kvCache.offload): host tier 16 GiB per replica, 16 GiB per pod (in its memory request); "
        "disk tier 100 GiB on emptyDir"
    )
    assert kv_offload.status(spec_mod.resolve(_doc()["spec"]).spec) is None


def test_kvserve_plan_shows_the_tiers_and_the_startup_budget(tmp_path, capsys):
    from kvserve.cli import plan as plan_cli
    from kvserve.operator import startup_budget

    doc = _doc(kvCache={"offload": {"hostSizeGiB": 16, "disk": {"sizeGiB": 100}}})
    path = tmp_path / "isvc.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert plan_cli.plan_file(str(path), "json") == 0
    out = json.loads(capsys.readouterr().out)
    resolved = spec_mod.resolve(doc["spec"])
    assert out["kvOffload"] == kv_offload.status(resolved.spec)
    assert out["startup"]["budgetSeconds"] == startup_budget.budget_seconds(resolved.spec, resolved.plan)
    assert plan_cli.plan_file(str(path), "table") == 0
    text = capsys.readouterr().out
    assert kv_offload.describe(out["kvOffload"]) in text
    assert f"startup probe: {out['startup']['budgetSeconds']} s" in text

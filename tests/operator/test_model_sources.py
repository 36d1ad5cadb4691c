"""Model sources in the operator, pure parts: spec validation naming the field, the rendered init container and
cache mounts for each source kind (upstream-schema valid), planning from a config.json, and the pod statuses
that become ModelReady."""

from __future__ import annotations

import copy
import json

import kubernetes_validate
import pytest
from kvserve_testing import STORIES_DIR

from kvserve.cli import download as cli_download
from kvserve.operator import pod_health, render, transitions
from kvserve.operator import spec as spec_mod
from kvserve.operator import status as status_mod
from kvserve.runtime import capacity
from kvserve.runtime.sources import uri as source_uri

STORIES_CONFIG = STORIES_DIR / "config.json"
BASE = {"model": {"name": "llama-3-8b", "uri": "hf://meta-llama/Meta-Llama-3-8B-Instruct"}, "gpu": {"product": "l4"}}
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}


def _spec(**model) -> dict:
    spec = copy.deepcopy(BASE)
    spec["model"].update(model)
    return spec


def _pod(spec: dict) -> dict:
    (dep,) = [o for o in render.render(spec_mod.resolve(spec), "m", "ml") if o["kind"] == "Deployment"]
    for obj in render.render(spec_mod.resolve(spec), "m", "ml"):
        kubernetes_validate.validate(obj, "1.33", strict=True)
    return dep["spec"]["template"]["spec"]


def test_hf_with_a_pvc_cache_downloads_once_into_the_keyed_folder_and_mounts_it_read_only():
    pod = _pod(_spec(revision="v2", credentials={"secretRef": {"name": "hf"}}, cache={"claimName": "cache"}))
    key = source_uri.cache_key(source_uri.parse("hf://meta-llama/Meta-Llama-3-8B-Instruct@v2"))
    (init,) = pod["initContainers"]
    assert init["command"] == [
        "kvserve",
        "download",
        "hf://meta-llama/Meta-Llama-3-8B-Instruct@v2",
        "--dest",
        f"/mnt/model-cache/models/{key}",
    ]
    assert init["envFrom"] == [{"secretRef": {"name": "hf"}}]
    assert {"name": "model-cache", "mountPath": "/mnt/model-cache", "readOnly": False} in init["volumeMounts"]
    engine = pod["containers"][0]
    assert engine["command"][2] == f"/mnt/model-cache/models/{key}" and "envFrom" not in engine
    assert {"name": "model-cache", "mountPath": "/mnt/model-cache", "readOnly": True} in engine["volumeMounts"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "cache"}} in pod["volumes"]


def test_s3_without_a_cache_downloads_into_the_pods_own_empty_dir():
    pod = _pod(_spec(uri="s3://models/llama/3-8b/"))
    (init,) = pod["initContainers"]
    assert init["command"] == ["kvserve", "download", "s3://models/llama/3-8b", "--dest", "/mnt/models/model"]
    assert "envFrom" not in init  # no Secret: boto3's own chain (an IRSA role, ...)
    assert {"name": "model", "emptyDir": {}} in pod["volumes"]
    assert pod["containers"][0]["command"][2] == "/mnt/models/model"


def test_host_path_cache_and_mounted_sources():
    pod = _pod(_spec(cache={"hostPath": "/var/lib/kvserve"}))
    assert {"name": "model-cache", "hostPath": {"path": "/var/lib/kvserve", "type": "DirectoryOrCreate"}} in pod[
        "volumes"
    ]
    for uri in ("pvc://models/llama3", "file:///models/llama3"):
        assert "initContainers" not in _pod(_spec(uri=uri))


@pytest.mark.parametrize(
    "model,field",
    [
        ({"uri": "gs://b/m"}, "spec.model.uri"),
        ({"uri": "hf://org/name@a", "revision": "b"}, "spec.model.revision"),
        ({"uri": "pvc://models/x", "revision": "main"}, "spec.model.revision"),
        ({"uri": "pvc://models/x", "cache": {"claimName": "c"}}, "spec.model.cache"),
        ({"cache": {"claimName": "c", "hostPath": "/x"}}, "spec.model.cache"),
    ],
)
def test_bad_sources_are_refused_naming_the_field(model, field):
    with pytest.raises(spec_mod.SpecError) as info:
        spec_mod.resolve(_spec(**model))
    assert info.value.reason == "InvalidModelSource" and field in info.value.message


def test_a_non_catalog_model_is_planned_from_its_config_json():
    spec = {"model": {"uri": "hf://org/tiny"}, "gpu": {"product": "l4"}, "engine": {"maxModelLen": 4096}}
    assert spec_mod.needs_model_config(spec)
    assert not spec_mod.needs_model_config(_spec())  # in the catalog
    assert not spec_mod.needs_model_config({"model": {"uri": "pvc://m/x"}})  # mounted: nothing to fetch
    with pytest.raises(spec_mod.SpecError, match="hf:// or s3://"):
        spec_mod.resolve(spec)  # without the config it cannot be planned
    resolved = spec_mod.resolve(spec, model_config=LLAMA_CONFIG)
    assert resolved.model == capacity.shape_from_hf_config(LLAMA_CONFIG)
    assert resolved.plan.fits and resolved.plan.kv_bytes_per_token == 2 * 4 * 2 * 64 * 2
    # spec.model.shape still overrides what config.json says.
    spec["model"]["shape"] = {"maxPositionEmbeddings": 2048}
    assert spec_mod.resolve(spec, model_config=LLAMA_CONFIG).plan.reason == "ContextExceedsModel"


def test_unsupported_architectures_are_refused_with_the_runtimes_list():
    spec = {"model": {"uri": "hf://org/gpt2"}, "gpu": {"product": "l4"}}
    with pytest.raises(spec_mod.SpecError) as info:
        spec_mod.resolve(spec, model_config={"architectures": ["GPT2LMHeadModel"], "n_layer": 12})
    assert info.value.reason == "UnsupportedArchitecture"
    assert "GPT2LMHeadModel" in info.value.message
    assert all(a in info.value.message for a in capacity.SUPPORTED_ARCHITECTURES)


def test_the_download_failure_prefix_is_one_string_in_two_places():
    assert pod_health.DOWNLOAD_FAILED_PREFIX == cli_download.DOWNLOAD_FAILED_PREFIX
    assert pod_health.DOWNLOAD_CONTAINER == render.render_model.DOWNLOAD_CONTAINER


def _init_pod(state: dict, last: dict | None = None) -> dict:
    status = {"name": "model-download", "ready": False, "state": state}
    if last:
        status["lastState"] = {"terminated": last}
    return {"metadata": {"name": "p"}, "status": {"initContainerStatuses": [status]}}


def test_model_ready_follows_the_init_container():
    failed = _init_pod(
        {"waiting": {"reason": "CrashLoopBackOff"}},
        {"exitCode": 1, "message": "kvserve: download failed: hf://o/n@main: token was rejected\n"},
    )
    failure = pod_health.diagnose([failed])
    assert failure.reason == "DownloadFailed" and "token was rejected" in failure.message
    assert pod_health.model_ready([failed], True, failure) == (False, "DownloadFailed", failure.message)
    running = _init_pod({"running": {}})
    assert pod_health.model_ready([running], True, None)[:2] == (False, "Downloading")
    done = _init_pod({"terminated": {"exitCode": 0}})
    assert pod_health.model_ready([done], True, None)[:2] == (True, "Downloaded")
    assert pod_health.model_ready([], False, None)[:2] == (True, "Mounted")


def test_download_failed_posts_one_event_and_downloading_none():
    def status(ok, reason):
        return status_mod.compute_status(
            name="m",
            namespace="ml",
            spec=spec_mod.parse(BASE),
            generation=1,
            plan=None,
            plan_reason="x",
            plan_message="",
            deployment=None,
            previous=None,
            now="t",
            model_ready=(ok, reason, f"{reason} message"),
        )

    downloading, failed = status(False, "Downloading"), status(False, "DownloadFailed")
    assert transitions.warnings(None, downloading) == transitions.warnings(None, status(True, "Downloaded"))
    new = [w for w in transitions.warnings(downloading, failed) if w[0] == "DownloadFailed"]
    assert new == [("DownloadFailed", "DownloadFailed message")]
    assert [w for w in transitions.warnings(failed, failed) if w[0] == "DownloadFailed"] == []


def test_plan_cli_from_a_config_file(capsys):
    from kvserve.cli.main import main

    assert (
        main(["plan", "--model-config", str(STORIES_CONFIG), "--gpu", "l4", "--max-model-len", "512", "-o", "json"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    # stories260K's config.json declares float32: dtype auto plans 4-byte KV, as `kvserve serve` allocates it.
    assert out["engine"]["dtype"] == "float32"
    assert out["fits"] and out["kv_bytes_per_token"] == 2 * 5 * 4 * 8 * 4
    assert out["model"]["num_layers"] == 5 and out["model"]["tie_word_embeddings"] is True


def test_the_router_of_a_downloaded_model_fetches_only_the_tokenizer():
    spec = _spec(credentials={"secretRef": {"name": "hf"}}, cache={"claimName": "cache"})
    spec["router"] = {"enabled": True}
    objs = render.render(spec_mod.resolve(spec), "m", "ml")
    for obj in objs:
        kubernetes_validate.validate(obj, "1.33", strict=True)
    (router,) = [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "m-router"]
    pod = router["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"][-3:] == ["--dest", "/mnt/models/tokenizer", "--no-weights"]
    assert init["envFrom"] == [{"secretRef": {"name": "hf"}}]
    assert {"name": "model", "emptyDir": {}} in pod["volumes"]  # not the engine's cache
    command = pod["containers"][0]["command"]
    assert command[command.index("--tokenizer") + 1] == "/mnt/models/tokenizer"

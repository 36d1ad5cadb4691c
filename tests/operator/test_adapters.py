"""spec.adapters (issue 24 item 5): LoRA adapters rendered into every replica's start-up, validated naming the
field, charged in the capacity plan exactly as the pod's runtime config allocates them, and reported in status
(adapters "ready/total", AdaptersReady / AdapterLoadFailed from the pods)."""

from __future__ import annotations

import copy
import json
import pathlib

import pytest
import yaml

from kvserve.operator import adapters, pod_health, render, status
from kvserve.operator import spec as spec_mod
from kvserve.runtime import capacity
from kvserve.runtime.executor import kv_sizing
from tests.kvserve_testing import STORIES_DIR
from tests.operator.test_capacity_contract import runtime_config_from_pod

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "llama3-8b-lora.yaml").read_text())


def _spec(**updates) -> dict:
    spec = copy.deepcopy(EXAMPLE["spec"])
    spec.update(updates)
    return spec


def _objs(spec: dict, name: str = "svc") -> list[dict]:
    return render.render(spec_mod.resolve(spec), name, "default")


def _engine_pod(objs: list[dict]) -> dict:
    return next(o for o in objs if o["kind"] == "Deployment" and not o["metadata"]["name"].endswith("-router"))["spec"][
        "template"
    ]


def _command(objs: list[dict]) -> list[str]:
    return _engine_pod(objs)["spec"]["containers"][0]["command"]


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


# -- rendering ------------------------------------------------------------------------------------------------
def test_every_replica_loads_every_adapter_at_start_up():
    template = _engine_pod(_objs(_spec()))
    pod = template["spec"]
    (engine,) = pod["containers"]
    cmd = engine["command"]
    assert _flag(cmd, "--lora-modules") == (
        "sql=/mnt/adapters/sql,support-chat=/mnt/adapters/support-chat,summarize=/mnt/adapter-claims/summarize"
    )
    assert "--enable-lora" in cmd and _flag(cmd, "--max-loras") == "3" and _flag(cmd, "--max-lora-rank") == "64"
    # One download init container per remote adapter, with its Secret; the engine mounts the result read-only.
    inits = {c["name"]: c for c in pod["initContainers"]}
    assert set(inits) == {"adapter-download-0", "adapter-download-1"}
    assert inits["adapter-download-1"]["command"] == [
        "kvserve",
        "download",
        "s3://adapters.example/llama3-8b/support-chat",
        "--dest",
        "/mnt/adapters/support-chat",
        "--adapter",
    ]
    assert inits["adapter-download-0"]["envFrom"] == [{"secretRef": {"name": "adapter-bucket"}}]
    assert "envFrom" not in engine  # the engine never sees the bucket's credentials
    mounts = {m["mountPath"]: m for m in engine["volumeMounts"]}
    assert mounts["/mnt/adapters"]["readOnly"] is True
    # The pvc:// adapter lives in the base model's claim: its volume, the adapter's folder as a subPath.
    assert mounts["/mnt/adapter-claims/summarize"] == {
        "name": "model",
        "mountPath": "/mnt/adapter-claims/summarize",
        "readOnly": True,
        "subPath": "adapters/summarize",
    }
    assert {"name": "adapters", "emptyDir": {}} in pod["volumes"]
    assert template["metadata"]["annotations"][adapters.POD_ANNOTATION] == "sql,support-chat,summarize"


def _catalog_model_dir(tmp_path: pathlib.Path, key: str) -> str:
    """A folder with the config.json of a catalog model (no weights: the runtime config needs none)."""
    from kvserve.runtime.planner import catalog
    from tests.operator.test_capacity_contract import hf_config

    model_dir = tmp_path / key
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(hf_config(catalog.MODELS[key])))
    return str(model_dir)


def test_the_rendered_lora_flags_build_the_runtime_lora_config(tmp_path):
    cmd = _command(_objs(_spec()))
    config = runtime_config_from_pod(cmd, _catalog_model_dir(tmp_path, "llama-3-8b"))  # as `kvserve serve` does
    assert config.lora.modules == (
        ("sql", "/mnt/adapters/sql"),
        ("support-chat", "/mnt/adapters/support-chat"),
        ("summarize", "/mnt/adapter-claims/summarize"),
    )
    assert (config.lora.max_loras, config.lora.max_lora_rank) == (3, 64)


def test_adapters_from_other_claims_and_files_and_default_rank():
    spec = _spec(
        adapters=[
            {"name": "a", "uri": "pvc://team-a/lora/a"},
            {"name": "b", "uri": "pvc://team-a/lora/b"},
            {"name": "c", "uri": "file:///opt/adapters/c"},
            {"name": "d", "uri": "hf://org/adapter-d@v2"},
        ]
    )
    pod = _engine_pod(_objs(spec))["spec"]
    cmd = pod["containers"][0]["command"]
    assert _flag(cmd, "--max-lora-rank") == "16"  # no rank given: the runtime's default
    claim_volumes = [v for v in pod["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == "team-a"]
    assert claim_volumes == [
        {"name": "adapter-claim-0", "persistentVolumeClaim": {"claimName": "team-a", "readOnly": True}}
    ]
    assert "c=/opt/adapters/c" in _flag(cmd, "--lora-modules")
    (init,) = pod["initContainers"]
    assert init["name"] == "adapter-download-3" and init["command"][2] == "hf://org/adapter-d@v2"
    assert "envFrom" not in init  # no credentials anywhere: anonymous


def test_no_adapters_renders_no_lora():
    spec = _spec()
    del spec["adapters"]
    cmd = _command(_objs(spec))
    assert not any(a.startswith("--") and "lora" in a for a in cmd)


def test_adapters_with_a_router_and_in_the_router_pod():
    # The router needs no adapters: only the engine pods load them.
    objs = _objs(_spec(router={"enabled": True}))
    router = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-router"))
    assert not any(
        c["name"].startswith("adapter-download-") for c in router["spec"]["template"]["spec"].get("initContainers", [])
    )
    assert "--lora-modules" in _command(objs)


# -- validation -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "entries,field",
    [
        (
            [{"name": "a", "uri": "s3://bkt/a"}, {"name": "a", "uri": "s3://bkt/b"}],
            "spec.adapters[1].name 'a' duplicates",
        ),
        ([{"name": "a", "uri": "gs://b/a"}], "spec.adapters[0].uri"),
        ([{"name": "ok", "uri": "s3://bkt/a"}, {"name": "x", "uri": "hf://org/name/extra"}], "spec.adapters[1].uri"),
        ([{"name": "a,b", "uri": "s3://bkt/a"}], "spec.adapters[0].name"),
        ([{"name": "llama-3-8b", "uri": "s3://bkt/a"}], "spec.adapters[0].name 'llama-3-8b' is the base model"),
        ([{"name": "a", "uri": "s3://bkt/a", "rank": 0}], "spec.adapters[0].rank"),
        (
            [{"name": "a", "uri": "pvc://c/a", "credentials": {"secretRef": {"name": "s"}}}],
            "spec.adapters[0].credentials",
        ),
        ([{"name": "a", "url": "s3://bkt/a"}], "spec.adapters[0].url"),
    ],
)
def test_bad_adapters_are_refused_naming_the_field(entries, field):
    with pytest.raises(spec_mod.SpecError) as err:
        spec_mod.resolve(_spec(adapters=entries))
    assert err.value.reason == "InvalidAdapter" and field in err.value.message, err.value.message


def test_extra_args_must_not_set_the_lora_flags_beside_adapters():
    spec = _spec(engine={"extraArgs": ["--max-loras=8"]})
    with pytest.raises(spec_mod.SpecError, match="spec.engine.extraArgs --max-loras conflicts with spec.adapters"):
        spec_mod.resolve(spec)


def test_adapters_on_a_multi_node_replica_are_refused_by_name():
    spec = {
        "model": {"name": "llama-3.1-405b", "uri": "pvc://models/405b"},
        "gpu": {"product": "h100-80gb", "tensorParallelSize": 8},
        "adapters": [{"name": "a", "uri": "s3://bkt/a"}],
    }
    resolved = spec_mod.resolve(spec)
    assert resolved.layout.multinode and not resolved.plan.fits
    assert resolved.plan.reason == "PipelineParallelUnsupported" and "spec.adapters" in resolved.plan.message
    assert render.render(resolved, "x", "default") == []
    del spec["adapters"]
    assert spec_mod.resolve(spec).plan.fits  # the same replica without adapters is served


# -- the capacity plan is what the pod allocates --------------------------------------------------------------
@pytest.mark.parametrize(
    "model,gpu,t,dtype",
    [("llama-3-8b", "l4", 1, "bfloat16"), ("llama-3-70b", "a100-80gb", 4, "fp8"), ("qwen2.5-7b", "a10g", 2, "float16")],
)
def test_plan_with_adapters_is_what_the_pod_command_allocates(model, gpu, t, dtype, tmp_path):
    model_dir = _catalog_model_dir(tmp_path, model)
    base = {
        "model": {"name": model, "uri": "file:///m", "dtype": dtype},
        "gpu": {"product": gpu, "tensorParallelSize": t},
    }
    with_adapters = {
        **base,
        "adapters": [{"name": "a", "uri": "s3://bkt/a", "rank": 8}, {"name": "b", "uri": "s3://bkt/b", "rank": 32}],
    }
    plain, lora = spec_mod.resolve(base).plan, spec_mod.resolve(with_adapters).plan
    assert plain.fits and lora.fits and plain.lora_slot_bytes_per_gpu == 0
    config = runtime_config_from_pod(
        _command(render.render(spec_mod.resolve(with_adapters), "x", "d")),
        model_dir,
    )
    # The runtime's LoRA config from the pod's flags, through the one slot formula, is the plan's charge ...
    assert (config.lora.max_loras, config.lora.max_lora_rank) == (2, 32)
    slots = capacity.lora_slot_bytes_per_rank(config.model.shape, 2, 32, config.model.weight_dtype, t)
    assert lora.lora_slot_bytes_per_gpu == slots > 0
    # ... and the pod's KV cache is the plan's: the budget without adapters less exactly those bytes.
    assert kv_sizing.explicit_num_blocks(config) == lora.num_blocks_per_gpu < plain.num_blocks_per_gpu
    block_bytes = kv_sizing.layout(config).budget_for_blocks(1)
    fewer = plain.num_blocks_per_gpu - lora.num_blocks_per_gpu  # floor((F - S) / b) vs floor(F / b)
    assert -(-slots // block_bytes) - 1 <= fewer <= -(-slots // block_bytes), (fewer, slots, block_bytes)


def _write_adapter(path: pathlib.Path, rank: int, seed: int) -> None:
    """A random PEFT-format adapter for stories260K (hidden 64, 8x8 query heads, 4 KV heads, MLP 172, 5 layers)."""
    from kvserve.runtime.models.synthetic import make_random_adapter_dir

    make_random_adapter_dir(str(STORIES_DIR), str(path), rank=rank, seed=seed)


def test_the_engine_the_pod_command_starts_allocates_the_planned_slots_and_blocks(tmp_path, monkeypatch):
    """The real engine built from the rendered pod's command (stories260K on CPU, two file:// adapters): the
    slot bytes its LoraManager allocated and its block count are the plan's, and each adapter is served."""
    from kvserve.runtime import SamplingParams
    from kvserve.runtime.engine.llm import LLM
    from kvserve.runtime.engine.llm_engine import LLMEngine

    _write_adapter(tmp_path / "a", rank=4, seed=1)
    _write_adapter(tmp_path / "b", rank=8, seed=2)
    spec = {
        "model": {"servedName": "stories", "uri": f"file://{STORIES_DIR}", "dtype": "float32"},
        "gpu": {"memoryMiB": 48},
        "engine": {"maxModelLen": 256, "maxNumSeqs": 8, "activationReserveMiB": 0, "runtimeOverheadMiB": 0},
        "adapters": [
            {"name": "a", "uri": f"file://{tmp_path / 'a'}", "rank": 4},
            {"name": "b", "uri": f"file://{tmp_path / 'b'}", "rank": 8},
        ],
    }
    # A 48 MiB "GPU" (a CPU-sized engine) is below the CRD's gpu.memoryMiB minimum of 1024: this drives the
    # planner directly, past the CRD's bound, which resolve would otherwise refuse (InvalidSpec).
    import pydantic

    from kvserve.operator import spec_model

    cpu_gpu = pydantic.create_model(
        "CPUSizedGPU", __base__=spec_model.GPUSpec, memory_mib=(int, pydantic.Field(alias="memoryMiB"))
    )
    unbounded = pydantic.create_model("UnboundedSpec", __base__=spec_model.InferenceServiceSpec, gpu=(cpu_gpu, ...))
    monkeypatch.setattr(spec_mod, "InferenceServiceSpec", unbounded)
    resolved = spec_mod.resolve(spec, model_config=json.loads((STORIES_DIR / "config.json").read_text()))
    plan = resolved.plan
    assert plan.fits and plan.lora_slot_bytes_per_gpu > 0
    cmd = _command(render.render(resolved, "x", "d"))
    llm = LLM.__new__(LLM)  # an LLM around the engine the pod's own config builds
    llm.engine = LLMEngine(runtime_config_from_pod(cmd, str(STORIES_DIR)))
    import itertools

    llm._ids = itertools.count()
    try:
        runner = llm.engine.executor.runner
        allocated = sum(t.numel() * t.element_size() for s in runner.lora.slots.values() for t in (s.a, s.b))
        assert allocated == plan.lora_slot_bytes_per_gpu
        assert runner.num_blocks == plan.num_blocks_per_gpu
        params = SamplingParams(max_tokens=8, temperature=0.0)
        outs = llm.generate(["Once upon a time"] * 3, params, lora_request=[None, "a", "b"])
        texts = [o.outputs[0].text for o in outs]
        assert len(set(texts)) == 3, texts  # each adapter changes the text: both were loaded and applied
    finally:
        llm.engine.shutdown()


# -- status ---------------------------------------------------------------------------------------------------
def _pod(name: str, ready: bool, served: str | None, **status_extra) -> dict:
    meta = {"name": name, **({"annotations": {adapters.POD_ANNOTATION: served}} if served is not None else {})}
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    return {"metadata": meta, "status": {"conditions": conditions, **status_extra}}


def test_adapters_served_counts_what_every_ready_pod_loaded():
    names = ["sql", "chat", "new"]
    assert adapters.served_by_ready_pods([], names) == 0
    assert adapters.served_by_ready_pods([_pod("p0", False, "sql,chat,new")], names) == 0  # not ready yet
    assert adapters.served_by_ready_pods([_pod("p0", True, "sql,chat,new")], names) == 3
    # Mid-rollout: an old ready pod without "new" keeps it from counting (a request routed there would 404).
    assert adapters.served_by_ready_pods([_pod("p0", True, "sql,chat"), _pod("p1", True, "sql,chat,new")], names) == 2
    terminating = _pod("old", True, "sql")
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert adapters.served_by_ready_pods([terminating, _pod("p1", True, "sql,chat,new")], names) == 3


def _status(pods: list[dict], ready: int) -> dict:
    resolved = spec_mod.resolve(_spec())
    deployment = {"status": {"replicas": 2, "readyReplicas": ready, "updatedReplicas": 2}}
    names = [a.name for a in resolved.adapters]
    return status.compute_status(
        name="svc",
        namespace="default",
        spec=resolved.spec,
        generation=1,
        plan=resolved.plan,
        plan_reason=resolved.plan.reason,
        plan_message=resolved.plan.message,
        deployment=deployment,
        previous=None,
        now="2026-01-01T00:00:00Z",
        pod_failure=pod_health.diagnose(pods),
        adapters=(adapters.served_by_ready_pods(pods, names), len(names)),
    )


def _cond(st: dict, ctype: str) -> dict:
    return next(c for c in st["conditions"] if c["type"] == ctype)


def _failed(name: str, container: str, message: str, init: bool) -> dict:
    failed = {
        "name": container,
        "ready": False,
        "restartCount": 3,
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": message}},
    }
    return _pod(
        name,
        False,
        "sql,support-chat,summarize",
        **{"initContainerStatuses" if init else "containerStatuses": [failed]},
    )


def test_a_bad_adapter_at_start_up_is_adapter_load_failed():
    """The engine's own termination message for a --lora-modules adapter it cannot load (the runtime exits at
    start-up; the pod never becomes ready) becomes AdaptersReady=False AdapterLoadFailed and Degraded."""
    from kvserve.runtime.lora.adapter import LoraLoadError, load_peft_adapter
    from kvserve.runtime.server.termination import termination_message

    with pytest.raises(LoraLoadError) as err:
        load_peft_adapter("sql", "/mnt/adapters/sql", 16)  # what the engine runs for each --lora-modules entry
    message = termination_message(err.value)
    assert message == "kvserve: startup failed: adapter 'sql': missing adapter_config.json in /mnt/adapters/sql"
    st = _status([_failed("svc-1", "kvserve", message, init=False)], ready=0)
    assert st["adapters"] == "0/3"
    cond = _cond(st, "AdaptersReady")
    assert cond["status"] == "False" and cond["reason"] == "AdapterLoadFailed" and "adapter 'sql'" in cond["message"]
    assert _cond(st, "Degraded")["reason"] == "AdapterLoadFailed"
    assert _cond(st, "Ready")["reason"] == "AdapterLoadFailed"


def test_a_failed_adapter_download_names_the_adapter_not_the_model():
    message = "kvserve: download failed: s3://adapters.example/llama3-8b/sql: AccessDenied"
    pods = [
        _failed("svc-1", "adapter-download-0", message, init=True),
        _pod("svc-0", True, "sql,support-chat,summarize"),
    ]
    st = _status(pods, ready=1)
    cond = _cond(st, "AdaptersReady")
    assert (
        cond["reason"] == "AdapterLoadFailed"
        and "spec.adapters[0]" in cond["message"]
        and "AccessDenied" in cond["message"]
    )
    assert st["adapters"] == "3/3"  # the ready pod serves them all; the new one cannot fetch sql


def test_all_adapters_served_and_no_adapters_no_status():
    st = _status([_pod("a", True, "sql,support-chat,summarize"), _pod("b", True, "sql,support-chat,summarize")], 2)
    assert st["adapters"] == "3/3" and _cond(st, "AdaptersReady")["status"] == "True"
    spec = _spec()
    del spec["adapters"]
    resolved = spec_mod.resolve(spec)
    plain = status.compute_status(
        name="svc",
        namespace="default",
        spec=resolved.spec,
        generation=1,
        plan=resolved.plan,
        plan_reason="",
        plan_message="",
        deployment=None,
        previous=None,
        now="t",
        adapters=None,
    )
    assert "adapters" not in plain and not any(c["type"] == "AdaptersReady" for c in plain["conditions"])


# -- the CRD --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "entry,expect",
    [
        ({"name": "a", "uri": "gs://bucket/a"}, "should match"),
        ({"name": "a=b", "uri": "s3://bkt/a"}, "should match"),
        ({"name": "a"}, "uri: Required value"),
        ({"name": "a", "uri": "s3://bkt/a", "rank": 0}, "greater than or equal to"),
        ({"name": "a", "uri": "s3://bkt/a", "revision": "v1"}, "unknown field"),
    ],
)
def test_the_crd_refuses_bad_adapters(entry, expect, admit):
    """The real API server's verdict (tests/operator/conftest.py admit)."""
    from tests.operator.test_crd import MINIMAL

    obj = copy.deepcopy(MINIMAL)
    obj["spec"]["adapters"] = [{"name": "ok", "uri": "hf://org/ok"}]
    admit(obj)
    obj["spec"]["adapters"].append(entry)
    with pytest.raises(ValueError, match=expect):
        admit(obj)


def test_the_crd_keys_adapters_by_name_and_shows_the_count():
    from tests.operator.test_crd import SCHEMA, VERSION

    node = SCHEMA["properties"]["spec"]["properties"]["adapters"]
    # The API server itself refuses two entries with one name (a list-map key must be unique).
    assert node["x-kubernetes-list-type"] == "map" and node["x-kubernetes-list-map-keys"] == ["name"]
    columns = {c["name"]: c["jsonPath"] for c in VERSION["additionalPrinterColumns"]}
    assert columns["Adapters"] == ".status.adapters"
    assert "adapters" in SCHEMA["properties"]["status"]["properties"]


def test_kvserve_download_adapter_takes_a_peft_folder_only(tmp_path):
    """`kvserve download --adapter` (the adapter-download init container) fetches adapter_config.json and the
    weights; without --adapter the same folder is refused (no config.json), and --adapter refuses a model."""
    from kvserve.cli.main import main

    _write_adapter(tmp_path / "src", rank=4, seed=3)
    log = tmp_path / "termination-log"
    base = ["download", f"file://{tmp_path / 'src'}", "--termination-log", str(log)]
    assert main([*base, "--dest", str(tmp_path / "out" / "sql"), "--adapter"]) == 0
    got = sorted(p.name for p in (tmp_path / "out" / "sql").iterdir())
    assert got == [".kvserve-complete.json", "adapter_config.json", "adapter_model.safetensors"]
    assert main([*base, "--dest", str(tmp_path / "out" / "as-model")]) == 1
    assert "found no config.json" in log.read_text()
    model = ["download", f"file://{STORIES_DIR}", "--termination-log", str(log), "--adapter"]
    assert main([*model, "--dest", str(tmp_path / "out" / "m")]) == 1
    assert log.read_text().startswith("kvserve: download failed: ") and "adapter_config.json" in log.read_text()

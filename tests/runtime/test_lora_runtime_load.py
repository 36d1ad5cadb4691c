"""Loading and unloading LoRA adapters at run time (issue 24): the engine core's registry
(runtime/lora/registry.py) and the utility thread beside the core's loop (runtime/engine/core_utilities.py).

- a reload under the same name with other weights never reuses the old adapter's prefix-cache blocks (the
  prefix-cache hit counter must not move), and loading the first weights again gives the first tokens;
- every refused load names the field: rank above --max-lora-rank, a target module the model lacks, a layer
  it lacks, a corrupt safetensors file, a duplicate name, a missing directory, unknown name on unload;
- unloading an adapter a running request uses never fails that request: the name leaves service at once,
  the weights stay until its last request finishes;
- a load runs on the utility thread: the core's loop is never blocked by it, and the caller's server hears
  the new registry (LORA_ADAPTERS) before its result.
"""

from __future__ import annotations

import json
import shutil
import threading

import pytest

peft = pytest.importorskip("peft")

from kvserve.runtime.lora.errors import LoraRequestError  # noqa: E402

PROMPT = list(range(3, 40))  # 37 tokens: two full 16-token blocks to cache
ENGINE = dict(
    max_model_len=96, num_kv_blocks=64, block_size=16, enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3
)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    from kvserve_testing import TEST_MODEL_CONFIGS, make_peft_adapter

    from kvserve.runtime.models.synthetic import make_random_model_dir

    root = tmp_path_factory.mktemp("lora-load")
    arch, kwargs = TEST_MODEL_CONFIGS["llama_gqa"]
    hf_model = make_random_model_dir(str(root / "base"), arch, seed=1234, dtype="float32", **kwargs)
    paths = {name: str(root / name) for name in ("a", "b", "r16")}
    make_peft_adapter(hf_model, paths["a"], r=8, alpha=16, seed=1)
    make_peft_adapter(hf_model, paths["b"], r=4, alpha=8, seed=2)
    make_peft_adapter(hf_model, paths["r16"], r=16, alpha=16, seed=3)
    return str(root / "base"), paths


@pytest.fixture(scope="module")
def engine(adapters):
    from kvserve.runtime.engine.llm_engine import LLMEngine

    eng = LLMEngine.from_kwargs(adapters[0], **ENGINE)
    yield eng
    eng.shutdown()


def _generate(engine, rid: str, name: str | None, max_tokens: int = 6) -> list[int]:
    from kvserve.runtime.sampling_params import SamplingParams

    engine.add_request(
        rid, PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, lora_name=name)
    )
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return list(out.outputs[0].token_ids)
    raise AssertionError("no output")


def _hits(engine) -> int:
    return engine.get_stats().prefix_cache_hits


def test_reload_with_other_weights_never_reuses_blocks(adapters, engine):
    registry = engine.core.lora_registry
    _, paths = adapters
    assert registry.load("x", paths["a"]) == {"x": paths["a"]}
    out_a = _generate(engine, "r1", "x")
    before = _hits(engine)
    assert _generate(engine, "r2", "x") == out_a
    assert _hits(engine) > before  # one loaded adapter: its prompt blocks are shared
    base = _generate(engine, "r3", None)
    assert base != out_a
    registry.unload("x")
    registry.load("x", paths["b"])  # same name, other weights
    shared = _hits(engine)
    out_b = _generate(engine, "r4", "x")
    assert _hits(engine) == shared, "a reloaded adapter reused the old adapter's prefix-cache blocks"
    assert out_b != out_a
    registry.load("x", paths["a"], load_inplace=True)  # the first weights again: the first tokens
    assert _generate(engine, "r5", "x") == out_a
    registry.unload("x")
    assert registry.adapters() == {}


def _refused(fn, *args, **kwargs) -> LoraRequestError:
    with pytest.raises(LoraRequestError) as info:
        fn(*args, **kwargs)
    return info.value


def test_refused_loads_name_the_field(adapters, engine, tmp_path):
    registry = engine.core.lora_registry
    _, paths = adapters
    err = _refused(registry.load, "big", paths["r16"])
    assert (err.status, err.param) == (400, "lora_path") and "r=16" in err.message and "max-lora-rank" in err.message

    bad_target = tmp_path / "bad_target"
    shutil.copytree(paths["a"], bad_target)
    config = json.loads((bad_target / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "fc_in"]
    (bad_target / "adapter_config.json").write_text(json.dumps(config))
    err = _refused(registry.load, "t", str(bad_target))
    assert (err.status, err.param) == (400, "lora_path") and "fc_in" in err.message

    corrupt = tmp_path / "corrupt"
    shutil.copytree(paths["a"], corrupt)
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    err = _refused(registry.load, "c", str(corrupt))
    assert (err.status, err.param) == (400, "lora_path") and "corrupt" in err.message

    extra_layer = tmp_path / "extra_layer"
    shutil.copytree(paths["a"], extra_layer)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(extra_layer / "adapter_model.safetensors"))
    for key in [k for k in tensors if ".layers.0." in k]:
        tensors[key.replace(".layers.0.", ".layers.99.")] = tensors[key].clone()
    save_file(tensors, str(extra_layer / "adapter_model.safetensors"))
    err = _refused(registry.load, "e", str(extra_layer))
    assert (err.status, err.param) == (400, "lora_path") and "layer 99" in err.message

    err = _refused(registry.load, "m", str(tmp_path / "missing"))
    assert (err.status, err.param) == (404, "lora_path")
    registry.load("dup", paths["a"])
    err = _refused(registry.load, "dup", paths["b"])
    assert (err.status, err.param, err.code) == (400, "lora_name", "lora_adapter_exists")
    registry.unload("dup")
    err = _refused(registry.unload, "dup")
    assert (err.status, err.param) == (404, "lora_name")
    assert registry.adapters() == {}  # nothing refused was registered


def test_unload_while_a_request_runs_lets_it_finish(adapters, engine):
    from kvserve.runtime.errors import InvalidParameter
    from kvserve.runtime.sampling_params import SamplingParams

    registry = engine.core.lora_registry
    registry.load("busy", adapters[1]["a"])
    expected = _generate(engine, "warm", "busy", max_tokens=8)
    engine.add_request("live", PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, lora_name="busy"))
    engine.step()  # prefill under the adapter
    registry.unload("busy")
    with pytest.raises(InvalidParameter, match="no such LoRA adapter"):
        engine.add_request("late", PROMPT, SamplingParams(max_tokens=2, lora_name="busy"))
    assert _refused(registry.load, "busy", adapters[1]["b"]).status == 409  # weights still in use
    tokens = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
    assert tokens == expected  # finished under the adapter it started with
    assert "busy" not in engine.executor.lora.cpu  # weights dropped with its last request


class _Socket:
    def __init__(self):
        self.frames: list[bytes] = []

    def send(self, frame, copy=True):
        self.frames.append(bytes(frame))


def test_core_utility_thread_never_blocks_the_loop(adapters, engine, monkeypatch):
    from kvserve.runtime.engine.core_messages import MessageCodec, MessageType, UtilityCall
    from kvserve.runtime.engine.core_utilities import CoreUtilities

    registry = engine.core.lora_registry
    release, started = threading.Event(), threading.Event()
    original = registry.manager.check

    def slow_check(adapter):  # the files are read: hold the load thread here
        started.set()
        assert release.wait(10)
        original(adapter)

    monkeypatch.setattr(registry.manager, "check", slow_check)
    utilities, codec, outs = CoreUtilities(engine.core), MessageCodec(), [_Socket(), _Socket()]
    utilities.submit(UtilityCall(7, 1, "load_lora_adapter", ["slow", adapters[1]["a"], False]))
    assert started.wait(10)
    assert _generate(engine, "during", None)  # the engine steps while the load is in progress
    utilities.send_finished(outs, codec)
    assert outs[0].frames == outs[1].frames == []
    release.set()
    for _ in range(200):
        utilities.send_finished(outs, codec)
        if outs[1].frames:
            break
        threading.Event().wait(0.01)
    kinds = [codec.decode(f)[0] for f in outs[1].frames]
    assert kinds == [MessageType.LORA_ADAPTERS, MessageType.UTILITY_RESULT]  # the registry first, then the answer
    assert [codec.decode(f)[0] for f in outs[0].frames] == [MessageType.LORA_ADAPTERS]
    result = codec.decode(outs[1].frames[1])[1]
    assert (result.call_id, result.status, result.value) == (7, 0, {"slow": adapters[1]["a"]})
    utilities.submit(UtilityCall(8, 0, "unload_lora_adapter", ["nope"]))
    for _ in range(200):
        utilities.send_finished(outs, codec)
        if len(outs[0].frames) > 1:
            break
        threading.Event().wait(0.01)
    refused = codec.decode(outs[0].frames[-1])[1]
    assert (refused.status, refused.param) == (404, "lora_name")
    utilities.shutdown()
    registry.unload("slow")

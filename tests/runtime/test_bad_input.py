"""Bad input raises a clear error naming the field, before any work starts; the engine keeps working."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.errors import InvalidParameter


@pytest.fixture(scope="module")
def llm(model_factory):
    model_dir, _ = model_factory("llama_gqa")
    return LLM(model_dir, max_model_len=64, num_kv_blocks=32, block_size=16)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-1), "temperature"),
        (dict(n=0), "n"),
        (dict(top_k=-5), "top_k"),
        (dict(min_p=2), "min_p"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(logprobs=100), "logprobs"),
        (dict(stop=[""]), "stop"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    ],
)
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(InvalidParameter) as info:
        SamplingParams(**kwargs)
    assert info.value.param == field and field in str(info.value)


def test_prompt_too_long_rejected_before_any_work(llm):
    ok = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(InvalidParameter, match=r"prompts\[1\].*max_model_len=64") as info:
        llm.generate([ok, {"prompt_token_ids": list(range(3, 70))}, ok], SamplingParams(max_tokens=3))
    assert info.value.param == "prompt"
    assert not llm.engine.has_unfinished_requests()
    outs = llm.generate([ok, ok], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]


@pytest.mark.parametrize("prompt", [{"prompt_token_ids": []}, {"prompt_token_ids": [1, 99999]}, {"foo": 1}, 3.5])
def test_bad_prompts(llm, prompt):
    with pytest.raises(InvalidParameter) as info:
        llm.generate([prompt], use_tqdm=False)
    assert info.value.param == "prompt"


def test_max_model_len_caps_generation(llm):
    out = llm.generate(
        [{"prompt_token_ids": list(range(3, 60))}],
        SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert len(out.outputs[0].token_ids) == 64 - 57 + 1 - 1 and out.outputs[0].finish_reason == "length"


def _copy_with_config(model_factory, dest, edit) -> str:
    """A copy of the llama_gqa model directory whose config.json went through `edit(cfg)`."""
    model_dir, _ = model_factory("llama_gqa")
    shutil.copytree(model_dir, dest)
    cfg = json.loads((dest / "config.json").read_text())
    edit(cfg)
    (dest / "config.json").write_text(json.dumps(cfg))
    return str(dest)


def test_unknown_architecture(tmp_path, model_factory):
    bad = _copy_with_config(
        model_factory, tmp_path / "bad", lambda cfg: cfg.update(architectures=["GPTNeoXForCausalLM"])
    )
    with pytest.raises(InvalidParameter, match="unsupported architecture") as info:
        LLM(bad)
    assert info.value.param == "model"


def test_sequence_length_dependent_rope_rejected(tmp_path, model_factory):
    def dynamic_rope(cfg):
        cfg["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
        cfg.pop("rope_parameters", None)

    bad = _copy_with_config(model_factory, tmp_path / "dynamic", dynamic_rope)
    with pytest.raises(InvalidParameter, match="rope_type 'dynamic'") as info:
        LLM(bad)
    assert info.value.param == "model"


def test_missing_weights_and_dir(tmp_path, model_factory):
    model_dir, _ = model_factory("llama_gqa")
    with pytest.raises(InvalidParameter, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    partial = tmp_path / "noweights"
    shutil.copytree(model_dir, partial)
    for f in os.listdir(partial):
        if f.endswith(".safetensors"):
            os.remove(partial / f)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(partial), num_kv_blocks=32)


def test_kv_budget_too_small_names_field_and_what_fits(model_factory):
    model_dir, _ = model_factory("llama_gqa")
    # llama_gqa: 2 layers x 2 kv heads x 8 dims x 2 (K,V) x 4 bytes = 256 B/token; 16-token blocks = 4 KiB.
    with pytest.raises(InvalidParameter, match=r"kv_cache_bytes.*max_model_len <= 48") as info:
        LLM(model_dir, max_model_len=256, kv_cache_bytes=4 * 4096, block_size=16)
    assert info.value.param == "kv_cache_bytes"
    with pytest.raises(InvalidParameter) as info:
        LLM(model_dir, block_size=12)
    assert info.value.param == "block_size"
    with pytest.raises(InvalidParameter) as info:
        LLM(model_dir, max_model_len=10**6)
    assert info.value.param == "max_model_len"

"""The benchmarks' real model (runtime/bench/real_model.py): a GGUF dequantised once into an HF folder in the
benchmark dtype, which vLLM's CPU build and kvserve both load. Checked on a random Q4_1 GGUF (the default
model's quant type): the stored tensors are the GGUF's values rounded once to the dtype, and kvserve's greedy
tokens from the folder equal those from the GGUF file itself."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("gguf")

from gguf_testing import random_llama_dir, write_gguf  # noqa: E402  (tests/ is on pythonpath)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> str:
    d = random_llama_dir(tmp_path_factory.mktemp("hf"), initializer_range=0.2)  # clear greedy winners
    out = tmp_path_factory.mktemp("gguf") / "model-Q4_1.gguf"
    return write_gguf(str(d), str(out), "Q4_1")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_folder_holds_the_gguf_values_in_the_dtype(gguf_file, dtype):
    import torch
    from safetensors.torch import load_file

    from kvserve.runtime.bench import real_model
    from kvserve.runtime.models.gguf_weights import iter_gguf

    folder = real_model.dequantised_dir(gguf_file, dtype)
    assert json.load(open(os.path.join(folder, "config.json")))["torch_dtype"] == dtype
    assert not os.path.exists(os.path.join(folder, "kvserve-gguf.json")), "loaders must read the folder's weights"
    assert os.path.exists(os.path.join(folder, "tokenizer.json"))
    stored = load_file(os.path.join(folder, real_model.WEIGHTS_FILE))
    expected = dict(iter_gguf(gguf_file, show_progress=False))
    assert stored.keys() == expected.keys()
    for name, t in expected.items():
        assert stored[name].dtype == getattr(torch, dtype), name
        assert torch.equal(stored[name], t.to(getattr(torch, dtype))), name
    assert real_model.dequantised_dir(gguf_file, dtype) == folder  # cached


def test_greedy_from_the_folder_equals_the_gguf(gguf_file):
    from kvserve.runtime import LLM, SamplingParams
    from kvserve.runtime.bench import real_model
    from kvserve.runtime.bench.real_prompts import chat_prompt_ids

    folder = real_model.dequantised_dir(gguf_file, "bfloat16")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = {}
    for source in (gguf_file, folder):
        llm = LLM(source, dtype="bfloat16", max_model_len=256)
        prompts = chat_prompt_ids(llm.tokenizer, 3, 40, seed=0)
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs[source] = [list(o.outputs[0].token_ids) for o in got]
        llm.shutdown()
    assert outs[gguf_file] == outs[folder]


def test_unknown_dtype_is_named(gguf_file):
    from kvserve.runtime.bench import real_model

    with pytest.raises(ValueError, match="dtype"):
        real_model.dequantised_dir(gguf_file, "int8")

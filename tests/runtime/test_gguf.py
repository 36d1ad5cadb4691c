"""GGUF checkpoints (issue 39, scope 2): `LLM("MODEL.gguf")` greedy output token-exact against transformers
loading the same file (`from_pretrained(dir, gguf_file=...)`), for every tensor type kvserve dequantises; the
config, tokenizer and chat template from the file's metadata; clear errors; `kvserve plan` from the header.

The files are written here (tests/gguf_testing.py) from a random HF Llama with a byte-level BPE tokenizer
and a ChatML template, so nothing is downloaded. The real SmolLM2 GGUF is tested in test_default_model.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from gguf_testing import random_llama_dir, write_gguf  # noqa: E402  (tests/ is on pythonpath)

from kvserve.runtime.errors import InvalidParameter  # noqa: E402

TENSOR_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K"]
MESSAGES = [
    [{"role": "user", "content": "Hello! How are you today?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "The robot lived in the lighthouse at the end of the pier."}],
]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    """A random Llama (GQA 4/2, head_dim 64: rows of 256 for the K-quants) with the demo's BPE tokenizer."""
    # initializer_range 0.2: peaked logits, clear greedy winners, no near-ties
    return random_llama_dir(tmp_path_factory.mktemp("hf"), initializer_range=0.2)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))


def _hf_greedy(gguf_path: str, max_new: int) -> tuple[list[list[int]], list[list[int]]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    prompts, outputs = [], []
    for messages in MESSAGES:
        ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False)
        prompts.append(ids)
        outputs.append(out[0, len(ids) :].tolist())
    return prompts, outputs


@pytest.mark.parametrize("tensor_type", TENSOR_TYPES)
def test_greedy_matches_transformers_on_the_same_gguf(hf_dir, tmp_path, tensor_type):
    from kvserve.runtime import LLM, SamplingParams

    path = write_gguf(hf_dir, str(tmp_path / f"model-{tensor_type}.gguf"), tensor_type)
    prompts, expected = _hf_greedy(path, max_new=12)
    llm = LLM(path, dtype="float32", max_model_len=256)
    # the chat template and tokenizer come from the file's metadata: the same prompt ids as transformers'
    for messages, ids in zip(MESSAGES, prompts):
        text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert llm.tokenizer(text)["input_ids"] == ids
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    got = [list(o.outputs[0].token_ids) for o in outs]
    # transformers stops at EOS; kvserve ran on (ignore_eos): compare what transformers produced
    assert [g[: len(e)] for g, e in zip(got, expected)] == expected
    assert sum(len(e) for e in expected) >= 24, "transformers stopped early on every prompt: nothing compared"


def test_dequantised_tensors_equal_transformers(hf_dir, tmp_path):
    """Every tensor, names and q/k un-permutation included, bit-identical to transformers' GGUF loading."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from kvserve.runtime.models.gguf_weights import iter_gguf

    path = write_gguf(hf_dir, str(tmp_path / "m.gguf"), "Q4_K")
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(config)
    ref = load_gguf_checkpoint(path, return_tensors=True, model_to_load=meta_model)["tensors"]
    ours = dict(iter_gguf(path, show_progress=False))
    assert ours.keys() == ref.keys()
    for name, tensor in ref.items():
        assert torch.equal(ours[name].float(), tensor), name


def test_config_matches_transformers(hf_dir, tmp_path):
    from transformers import AutoConfig

    from kvserve.runtime import gguf_config

    path = write_gguf(hf_dir, str(tmp_path / "m.gguf"), "Q8_0")
    ours = gguf_config.hf_config(path)
    ref = AutoConfig.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "eos_token_id",
    ):
        assert ours[key] == getattr(ref, key), key
    assert ours["rope_theta"] == ref.rope_parameters["rope_theta"]
    assert ours["architectures"] == ["LlamaForCausalLM"] and ours["torch_dtype"] == "float32"


def _write_minimal(path: str, arch: str = "llama", tensor_type: str = "F32") -> str:
    import gguf
    from gguf import GGMLQuantizationType as T

    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    if tensor_type == "IQ4_NL":  # 18-byte blocks of 32 weights; gguf-py reads but kvserve refuses it
        w.add_tensor("blk.0.ffn_up.weight", np.zeros((4, 18), dtype=np.uint8), raw_dtype=T.IQ4_NL)
    else:
        w.add_tensor("blk.0.ffn_up.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_clear_errors(tmp_path):
    from kvserve.runtime import LLM, gguf_config

    with pytest.raises(InvalidParameter, match="GGUF architecture 'gpt2' is not supported; supported: llama") as e:
        gguf_config.hf_config(_write_minimal(str(tmp_path / "a.gguf"), arch="gpt2"))
    assert e.value.param == "model"
    with pytest.raises(InvalidParameter, match=r"tensor blk\.0\.ffn_up\.weight has GGUF type IQ4_NL"):
        gguf_config.hf_config(_write_minimal(str(tmp_path / "b.gguf"), tensor_type="IQ4_NL"))
    with pytest.raises(InvalidParameter, match="does not exist"):
        LLM(str(tmp_path / "missing.gguf"))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(InvalidParameter, match="is not a readable GGUF file"):
        LLM(str(tmp_path / "junk.gguf"))


def test_prepared_dir_is_reused_and_follows_the_file(hf_dir, tmp_path):
    from kvserve.runtime import gguf_model_dir

    path = write_gguf(hf_dir, str(tmp_path / "m.gguf"), "Q8_0")
    first = gguf_model_dir.prepare(path)
    assert gguf_model_dir.prepare(path) == first  # cached
    assert gguf_model_dir.gguf_file(first) == os.path.abspath(path)
    assert not list(Path(first).glob("*.safetensors")), "no dequantised copy is stored"
    os.utime(path, ns=(1, 1))  # the file changed: a new directory, and the old one refuses to load
    assert gguf_model_dir.prepare(path) != first
    with pytest.raises(InvalidParameter, match="has changed or is gone"):
        gguf_model_dir.gguf_file(first)


def test_tokenizer_flag(hf_dir, tmp_path):
    from kvserve.runtime import gguf_model_dir

    path = write_gguf(hf_dir, str(tmp_path / "m.gguf"), "Q8_0")
    with_own = gguf_model_dir.prepare(path)
    with_given = gguf_model_dir.prepare(path, tokenizer=hf_dir)
    assert with_own != with_given
    with pytest.raises(InvalidParameter, match="cannot load a tokenizer from") as e:
        gguf_model_dir.prepare(path, tokenizer=str(tmp_path / "nowhere"))
    assert e.value.param == "tokenizer"
    with pytest.raises(InvalidParameter, match="GGUF models only") as e:
        gguf_model_dir.resolve(hf_dir, tokenizer=hf_dir)


def test_plan_reads_the_gguf_header(hf_dir, tmp_path, capsys):
    from kvserve.cli.main import main

    path = write_gguf(hf_dir, str(tmp_path / "m.gguf"), "Q4_0")
    rc = main(["plan", "--model-config", path, "--gpu", "a100-80gb"])
    out = capsys.readouterr().out
    assert rc in (0, None), out
    assert "LlamaForCausalLM, 2 layers, 4 heads / 2 KV heads x 64, hidden 256" in out


@pytest.mark.parametrize("tensor_type", TENSOR_TYPES)
def test_tensor_table_reader_equals_gguf_reader(hf_dir, tmp_path, tensor_type):
    """models/gguf_tensors.py (the loader's fast path: no metadata values parsed) gives every tensor's name,
    type and bytes exactly as gguf's GGUFReader, and iter_gguf yields the same tensors through either."""
    import json

    from gguf import GGUFReader

    from kvserve.runtime import gguf_model_dir
    from kvserve.runtime.models.gguf_tensors import read_tensors
    from kvserve.runtime.models.gguf_weights import iter_gguf

    path = write_gguf(hf_dir, str(tmp_path / "m.gguf"), tensor_type)
    ref = GGUFReader(path).tensors
    ours = read_tensors(path)
    assert [(t.name, t.tensor_type) for t in ours] == [(t.name, t.tensor_type) for t in ref]
    for mine, theirs in zip(ours, ref):
        assert mine.data.dtype == theirs.data.dtype and np.array_equal(mine.data, theirs.data), mine.name
    config = json.loads((Path(gguf_model_dir.resolve(path)) / "config.json").read_text())
    slow, fast = dict(iter_gguf(path, show_progress=False)), dict(iter_gguf(path, show_progress=False, config=config))
    assert slow.keys() == fast.keys() and all(torch.equal(slow[k], fast[k]) for k in slow)
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"GGML" + bytes(60))
    assert read_tensors(str(not_gguf)) is None  # the caller falls back to GGUFReader (and its error)

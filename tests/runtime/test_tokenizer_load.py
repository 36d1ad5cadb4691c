"""load_tokenizer's short way to TokenizersBackend (runtime/tokenizer.py, issue 43) gives the tokenizer
AutoTokenizer gives: same class, vocabulary, special tokens, ids, decoded text and chat-template strings, on
the demo model's directory and on the directory `kvserve serve MODEL.gguf` prepares (what the default model,
SmolLM2's GGUF, is served from); and it does not import a model config class."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvserve.runtime.tokenizer import FALLBACK_CHAT_TEMPLATE, chat_template, load_tokenizer, tokenizers_backend_class
from tests.gguf_testing import random_llama_dir, write_gguf

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnew lines",
    "unicode: naïve café 東京 🙂",
    "",
]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2+2?"},
]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> str:
    from kvserve.runtime.demo_model import ensure_demo_model

    return str(ensure_demo_model(tmp_path_factory.mktemp("kvserve-cache")))


@pytest.fixture(scope="module")
def gguf_prepared_dir(tmp_path_factory) -> str:
    from kvserve.runtime import gguf_model_dir

    root = tmp_path_factory.mktemp("gguf")
    (root / "hf").mkdir()
    hf_dir = random_llama_dir(root / "hf")
    path = write_gguf(hf_dir, str(root / "m.gguf"), "Q8_0")
    return gguf_model_dir.prepare(path, cache_dir=root / "cache")


def auto_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def assert_same_tokenizer(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    assert len(ours) == len(theirs)
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert ours.all_special_ids == theirs.all_special_ids
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token) == (
        theirs.bos_token,
        theirs.eos_token,
        theirs.pad_token,
        theirs.unk_token,
    )
    assert chat_template(ours) == chat_template(theirs)
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), (text, special)
            assert ours(text).input_ids == theirs(text).input_ids
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    template = chat_template(theirs)
    for add_generation_prompt in (True, False):
        rendered = ours.apply_chat_template(
            CONVERSATION, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert rendered == theirs.apply_chat_template(
            CONVERSATION, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours.encode(rendered, add_special_tokens=False) == theirs.encode(rendered, add_special_tokens=False)


@pytest.mark.parametrize("which", ["demo", "gguf"])
def test_short_way_gives_autotokenizers_tokenizer(which, demo_dir, gguf_prepared_dir):
    model_dir = demo_dir if which == "demo" else gguf_prepared_dir
    assert tokenizers_backend_class(model_dir) is not None  # the short way is taken for both
    assert_same_tokenizer(load_tokenizer(model_dir), auto_tokenizer(model_dir))


def test_the_fallback_template_renders_the_same(demo_dir):
    ours, theirs = load_tokenizer(demo_dir), auto_tokenizer(demo_dir)
    kwargs = dict(chat_template=FALLBACK_CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(CONVERSATION, **kwargs) == theirs.apply_chat_template(CONVERSATION, **kwargs)


@pytest.mark.parametrize(
    "config_changes, tokenizer_config",
    [
        ({"model_type": "qwen2"}, None),  # a model type with its own tokenizer class: AutoTokenizer decides
        ({"auto_map": {"AutoConfig": "x.Y"}}, None),  # remote code
        ({}, {"tokenizer_class": "LlamaTokenizerFast"}),  # another declared class
        ({}, {"tokenizer_class": "TokenizersBackend", "auto_map": {"AutoTokenizer": ["a", "b"]}}),
    ],
)
def test_anything_else_is_left_to_autotokenizer(demo_dir, tmp_path, config_changes, tokenizer_config):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(demo_dir, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, **config_changes}))
    if tokenizer_config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    assert tokenizers_backend_class(str(d)) is None


def test_loading_the_demo_tokenizer_imports_no_model_config_class(demo_dir):
    code = (
        "import sys\n"
        "from kvserve.runtime.tokenizer import load_tokenizer\n"
        f"load_tokenizer({demo_dir!r})\n"
        "heavy = {'transformers.utils.type_validators', 'transformers.models.llama.configuration_llama'}\n"
        "print(sorted(heavy & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

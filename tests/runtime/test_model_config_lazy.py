"""ModelConfig without transformers (issue 43): the API server builds the engine config from config.json alone
and hands it to the engine-core process; transformers' AutoConfig (seconds of imports) is loaded only where the
model code asks for `hf_config`, and never travels in a pickle."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest

from kvserve.runtime.config import load_hf_config, load_model_config


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> str:
    from kvserve.runtime.demo_model import ensure_demo_model

    return str(ensure_demo_model(tmp_path_factory.mktemp("kvserve-cache")))


def eos_as_before(model_dir: str) -> tuple[int, ...]:
    """The EOS ids as load_model_config found them before: AutoConfig's eos_token_id plus
    generation_config.json's."""
    ids: set[int] = set()
    path = os.path.join(model_dir, "generation_config.json")
    generation = json.load(open(path)) if os.path.isfile(path) else {}
    for source in (getattr(load_hf_config(model_dir), "eos_token_id", None), generation.get("eos_token_id")):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(int(i) for i in source)
    return tuple(sorted(ids))


def variant(demo_dir: str, tmp_path, name: str, **changes) -> str:
    """A copy of the demo model's config.json (and generation_config.json) with `changes`; None removes a key."""
    d = tmp_path / name
    d.mkdir()
    config = json.load(open(os.path.join(demo_dir, "config.json")))
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (d / "config.json").write_text(json.dumps(config))
    generation = os.path.join(demo_dir, "generation_config.json")
    if os.path.isfile(generation):
        (d / "generation_config.json").write_text(open(generation).read())
    return str(d)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"eos_token_id": [2, 5]},
        {"eos_token_id": None},  # absent: the architecture's default, from AutoConfig as before
        {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "eos_token_id": None},
        {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "eos_token_id": None},
        {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "eos_token_id": 7},
        {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
        {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "eos_token_id": None},
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items() if k != "architectures") or "demo",
)
def test_eos_ids_are_what_autoconfig_gave(demo_dir, tmp_path, changes):
    d = variant(demo_dir, tmp_path, "m", **changes)
    assert load_model_config(d, "float32").eos_token_ids == eos_as_before(d)


def test_hf_config_is_loaded_on_first_use_and_equals_autoconfig(demo_dir):
    model = load_model_config(demo_dir, "float32")
    assert model._hf_config is None  # config.json names its EOS token: nothing needed AutoConfig yet
    assert model.hf_config.to_dict() == load_hf_config(demo_dir).to_dict()
    assert model.hf_config is model.hf_config  # loaded once


def test_a_pickled_config_leaves_hf_config_behind_and_reloads_it(demo_dir):
    model = load_model_config(demo_dir, "float32")
    expected = model.hf_config.to_dict()
    data = pickle.dumps(model)
    assert b"transformers" not in data  # unpickling must not import transformers' config classes
    copy = pickle.loads(data)
    assert copy == model and copy._hf_config is None
    assert copy.hf_config.to_dict() == expected


def test_building_the_engine_config_imports_no_transformers(demo_dir):
    """What `kvserve serve`'s API-server process runs before it hands the config to the engine core."""
    code = (
        "import sys\n"
        "from kvserve.runtime.config import build_engine_config\n"
        "from kvserve.runtime.engine_args import EngineArgs\n"
        f"config = build_engine_config(EngineArgs(model={demo_dir!r}, device='cpu', attention_backend='torch'))\n"
        "import pickle; pickle.loads(pickle.dumps(config))\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'torch'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

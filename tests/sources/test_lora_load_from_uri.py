"""`/v1/load_lora_adapter` with `lora_path` an hf:// / file:// URI (issue 24: "loading from a local dir or any
model source URI kvserve already understands"), against the local hub server: the adapter is downloaded by
the API server while requests keep being served, then serves the same tokens as the same adapter loaded from
a local folder; a URI already downloaded is reused; bad URIs are 4xx naming lora_path."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from kvserve_testing import STORIES_DIR

from tests.sources.conftest import REPO_ID, TOKEN
from tests.sources.hub_server import HubServer, Repo

ADAPTER_REPO = "kvserve-test/sql-lora"
ENGINE = dict(
    enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=4, kv_cache_bytes=8 << 20, max_num_seqs=4, seed=0
)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    from kvserve.runtime.models.synthetic import make_random_adapter_dir

    return make_random_adapter_dir(str(STORIES_DIR), str(tmp_path_factory.mktemp("src") / "sql"), rank=4, seed=1)


@pytest.fixture(scope="module")
def hub(adapter_dir):
    adapter = Repo.from_folder(ADAPTER_REPO, adapter_dir, private=True, token=TOKEN)
    model = Repo.from_folder(REPO_ID, str(STORIES_DIR), private=True, token=TOKEN)
    with pytest.MonkeyPatch.context() as mp, HubServer(adapter, model) as server:
        mp.setenv("HF_ENDPOINT", server.url)
        mp.setenv("HF_TOKEN", TOKEN)
        mp.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        yield server


@pytest.fixture(scope="module")
def server(hub, tmp_path_factory):
    from kvserve.runtime.engine.llm_engine import LLMEngine
    from tests.server.conftest import LiveServer

    srv = LiveServer(
        LLMEngine.from_kwargs(model=str(STORIES_DIR), **ENGINE),
        served_model_names=["stories"],
        model_dir=str(STORIES_DIR),
        allow_runtime_lora_updating=True,
        lora_download_dir=str(tmp_path_factory.mktemp("downloads")),
    )
    yield srv
    srv.stop()


def _load(server, name: str, path: str) -> httpx.Response:
    return httpx.post(
        server.base_url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=60
    )


def _text(server, model: str) -> str:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def test_hf_adapter_downloads_beside_running_requests_and_serves_like_the_local_one(hub, server, adapter_dir):
    hub.faults.stall_after["adapter_model.safetensors"] = 100  # the weights stall until released
    answer: dict = {}
    loading = threading.Thread(target=lambda: answer.setdefault("resp", _load(server, "sql", f"hf://{ADAPTER_REPO}")))
    loading.start()
    deadline = time.monotonic() + 30
    while not hub.requests("GET", "adapter_model.safetensors"):
        assert time.monotonic() < deadline, "the download did not start"
        time.sleep(0.02)
    base = _text(server, "stories")  # served while the adapter's download is stuck mid-file
    assert loading.is_alive() and "resp" not in answer
    hub.faults.release.set()
    loading.join(60)
    assert answer["resp"].status_code == 200, answer["resp"].text
    assert answer["resp"].text == "Success: LoRA adapter 'sql' added successfully."
    assert _load(server, "local", adapter_dir).status_code == 200
    assert _text(server, "sql") == _text(server, "local") != base  # the downloaded bytes are the adapter's
    cards = {c["id"]: c for c in httpx.get(server.base_url + "/v1/models").json()["data"]}
    assert cards["sql"]["parent"] == "stories"
    assert cards["sql"]["root"].startswith(server.config.lora_download_dir)
    # the same URI again (another name) reuses the finished download, and file:// is a local folder
    fetched = len(hub.requests("GET", "adapter_model.safetensors"))
    assert _load(server, "sql-again", f"hf://{ADAPTER_REPO}").status_code == 200
    assert len(hub.requests("GET", "adapter_model.safetensors")) == fetched
    assert _load(server, "from-file", f"file://{adapter_dir}").status_code == 200
    assert _text(server, "from-file") == _text(server, "sql")
    for name in ("sql", "local", "sql-again", "from-file"):
        assert httpx.post(server.base_url + "/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200


@pytest.mark.parametrize(
    "lora_path, status, code, says",
    [
        ("gs://bucket/sql", 400, "invalid_lora_path", "no supported scheme"),
        ("pvc://adapters/sql", 400, "invalid_lora_path", "mounted at pod start-up"),
        (f"hf://{REPO_ID}", 400, "lora_download_failed", "adapter_config.json"),  # a model, not an adapter
        ("hf://kvserve-test/no-such-adapter", 400, "lora_download_failed", "no-such-adapter"),
        ("file:///no/such/adapter", 404, None, "/no/such/adapter"),
    ],
)
def test_bad_uris_are_4xx_naming_lora_path(server, lora_path, status, code, says):
    resp = _load(server, "bad", lora_path)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == "lora_path" and says in error["message"]
    if code is not None:
        assert error["code"] == code
    assert "bad" not in {c["id"] for c in httpx.get(server.base_url + "/v1/models").json()["data"]}

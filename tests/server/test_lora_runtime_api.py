"""/v1/load_lora_adapter and /v1/unload_lora_adapter against the real `kvserve serve` (issue 24), run as
`--api-server-count 2` in front of one engine core, so every step also checks that both API servers see
what was loaded through one of them (the registry lives in the core):

load -> both servers list it in /v1/models (parent = the base model) and serve it (same greedy text, not
the base model's); the refusals name the field (duplicate, rank above --max-lora-rank, a target the model
lacks, a corrupt file, a missing field, unload of an unknown name); kvserve:lora_requests_total counts the
requests per adapter over the group; unload -> gone from /v1/models and 404 on both servers; a reload of
the name with other weights gives other text and no prefix-cache hit (the old blocks are never reused).
"""

from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest

peft = pytest.importorskip("peft")

from tests.server.test_api_server_count import wait_all_healthy  # noqa: E402
from tests.server.test_drain import ServeProcess  # noqa: E402
from tests.server.test_metrics_and_load import scrape, value  # noqa: E402

pytestmark = pytest.mark.timeout(240)
PROMPT = list(range(5, 45))  # 40 token ids: two full 16-token blocks to cache


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from kvserve_testing import TEST_MODEL_CONFIGS, make_peft_adapter

    from kvserve.runtime.models.synthetic import make_random_model_dir

    root = tmp_path_factory.mktemp("lora-runtime")
    arch, kwargs = TEST_MODEL_CONFIGS["llama_gqa"]
    hf_model = make_random_model_dir(str(root / "base"), arch, seed=1234, dtype="float32", **kwargs)
    paths = {name: str(root / name) for name in ("a", "b", "r16")}
    make_peft_adapter(hf_model, paths["a"], r=8, alpha=16, seed=1)
    make_peft_adapter(hf_model, paths["b"], r=8, alpha=16, seed=2)
    make_peft_adapter(hf_model, paths["r16"], r=16, alpha=16, seed=3)
    bad_target = root / "bad_target"
    shutil.copytree(paths["a"], bad_target)
    config = json.loads((bad_target / "adapter_config.json").read_text())
    (bad_target / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "fc_in"]}))
    corrupt = root / "corrupt"
    shutil.copytree(paths["a"], corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken")
    paths.update(bad_target=str(bad_target), corrupt=str(corrupt))
    return str(root / "base"), paths, str(root)


@pytest.fixture(scope="module")
def group(setup):
    model_dir, _, cache = setup
    flags = ["--max-model-len", "256", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
    proc = ServeProcess(cache, model_dir, *flags, "--allow-runtime-lora-updating", "--api-server-count", "2")
    try:
        wait_all_healthy(proc.base_url, 2)
    except BaseException:
        proc.kill()
        raise
    yield proc
    proc.kill()


SENT: dict[str, int] = {}  # requests _each_server sent per model (the kernel picks the server: several may be needed)


def _each_server(url: str, method: str, path: str, **kwargs) -> dict[str, httpx.Response]:
    """The same request on fresh connections until both API servers (x-kvserve-api-server) answered."""
    answers: dict[str, httpx.Response] = {}
    for _ in range(200):
        resp = httpx.request(method, url + path, timeout=60, **kwargs)
        model = (kwargs.get("json") or {}).get("model")
        if model is not None and resp.status_code == 200:
            SENT[model] = SENT.get(model, 0) + 1
        answers.setdefault(resp.headers.get("x-kvserve-api-server", "-"), resp)
        if len(answers) == 2:
            return answers
    raise AssertionError(f"only API servers {sorted(answers)} answered")


def _complete(model: str) -> dict:
    return {"json": {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}}


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def _error(resp: httpx.Response, status: int, param: str) -> str:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    return err["message"]


def _settled_prefix_cache_hits(url: str) -> float:
    """vllm:prefix_cache_hits once it stops moving. One API server of the group exports the core's counters,
    and it applies the stats that came with another server's request only when its own loop wakes (within its
    0.5 s idle wait): a scrape right after a completion may miss that completion's hits."""
    last = None
    for _ in range(20):
        now = value(scrape(url), "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
        if now == last:
            return now
        last = now
        time.sleep(1.0)
    raise AssertionError(f"vllm:prefix_cache_hits never settled (last {last})")


def test_load_use_list_unload_and_errors_across_two_api_servers(setup, group):
    model_dir, paths, _ = setup
    url = group.base_url
    base = {
        i: r.json()["choices"][0]["text"]
        for i, r in _each_server(url, "POST", "/v1/completions", **_complete(model_dir)).items()
    }

    resp = _post(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": paths["a"]})
    assert resp.status_code == 200 and resp.text == "Success: LoRA adapter 'x' added successfully.", resp.text
    for resp in _each_server(url, "GET", "/v1/models").values():  # at once, on the server that did not load it
        cards = {m["id"]: m for m in resp.json()["data"]}
        assert cards["x"]["parent"] == model_dir and cards["x"]["root"] == paths["a"], cards
    texts = {
        i: r.json()["choices"][0]["text"]
        for i, r in _each_server(url, "POST", "/v1/completions", **_complete("x")).items()
    }
    assert len(set(texts.values())) == 1 and texts["0"] != base["0"], (texts, base)

    assert "already been loaded" in _error(
        _post(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": paths["b"]}), 400, "lora_name"
    )
    assert "max-lora-rank" in _error(
        _post(url, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": paths["r16"]}), 400, "lora_path"
    )
    assert "fc_in" in _error(
        _post(url, "/v1/load_lora_adapter", {"lora_name": "t", "lora_path": paths["bad_target"]}), 400, "lora_path"
    )
    assert "corrupt" in _error(
        _post(url, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": paths["corrupt"]}), 400, "lora_path"
    )
    _error(_post(url, "/v1/load_lora_adapter", {"lora_name": "p"}), 400, "lora_path")
    _error(_post(url, "/v1/unload_lora_adapter", {"lora_name": "nope"}), 404, "lora_name")

    families = scrape(url)
    # Every completion for "x" counted once, whichever API server took it (the sum over both servers).
    assert value(families, "kvserve:lora_requests", "kvserve:lora_requests_total", lora_name="x") == SENT["x"] >= 2
    hits = _settled_prefix_cache_hits(url)

    resp = _post(url, "/v1/unload_lora_adapter", {"lora_name": "x"})
    assert resp.status_code == 200 and resp.text == "Success: LoRA adapter 'x' removed successfully.", resp.text
    time.sleep(1.0)  # the core's LORA_ADAPTERS reaches an idle API server within its 0.5 s idle wait
    for resp in _each_server(url, "POST", "/v1/completions", **_complete("x")).values():
        _error(resp, 404, "model")
    for resp in _each_server(url, "GET", "/v1/models").values():
        assert "x" not in {m["id"] for m in resp.json()["data"]}

    assert _post(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": paths["b"]}).status_code == 200
    reloaded = _post(url, "/v1/completions", _complete("x")["json"])
    assert reloaded.status_code == 200 and reloaded.json()["choices"][0]["text"] != texts["0"]
    after = _settled_prefix_cache_hits(url)
    assert after == hits, "the reloaded adapter reused prefix-cache blocks computed under the old weights"

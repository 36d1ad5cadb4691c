"""The engine front verifies a request once on each path (engine/front.py): sampling_params.verify_request
runs exactly once per request -- served (in the API server: the core, in-process or in its own process, does
not verify again) and offline (the LLM checks every prompt before queueing, the engine does not repeat it)."""

from __future__ import annotations

import pathlib
import threading

import httpx
import pytest

from kvserve.runtime import sampling_params
from kvserve.runtime.sampling_params import SamplingParams
from tests.server.conftest import LiveServer, make_engine

RUNTIME = pathlib.Path(__file__).resolve().parents[2] / "runtime"


@pytest.fixture
def verify_calls(monkeypatch):
    """Every call of the verify function in this process: (prompt length, n)."""
    calls, lock, real = [], threading.Lock(), sampling_params.verify_request

    def counting(prompt_token_ids, params, limits, prompt_param="prompt"):
        with lock:
            calls.append((len(prompt_token_ids), params.n))
        return real(prompt_token_ids, params, limits, prompt_param)

    monkeypatch.setattr(sampling_params, "verify_request", counting)
    return calls


def test_offline_verifies_each_request_once(offline_llm, verify_calls):
    params = SamplingParams(temperature=0, max_tokens=2, n=2)
    outs = offline_llm.generate(["a b c", "d e", [5, 6, 7, 8]], params, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [2, 2, 2]
    assert len(verify_calls) == 3  # one per request, none per child sample, none in the core
    assert sorted(n for _, n in verify_calls) == [2, 2, 2]


def test_engine_add_request_verifies_once(offline_llm, verify_calls):
    engine = offline_llm.engine
    engine.add_request("once-1", "hello there", SamplingParams(temperature=0, max_tokens=2, n=3))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(verify_calls) == 1


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process core", "core process"])
def test_served_request_is_verified_once(demo_model_dir, verify_calls, in_process):
    srv = LiveServer(make_engine(demo_model_dir, in_process=in_process), model_dir=demo_model_dir)
    try:
        body = {"model": srv.model, "prompt": ["one two", "three"], "max_tokens": 2, "n": 2, "temperature": 0}
        resp = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200 and len(resp.json()["choices"]) == 4
        assert len(verify_calls) == 2  # two prompts: two requests, each verified once (in the API server)
        chat = {"model": srv.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(srv.base_url + "/v1/chat/completions", json=chat, timeout=60).status_code == 200
        assert len(verify_calls) == 3
        too_long = {"model": srv.model, "prompt": "x", "max_tokens": 10**6}
        refused = httpx.post(srv.base_url + "/v1/completions", json=too_long, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
        assert len(verify_calls) == 4
    finally:
        srv.stop()


def test_only_the_front_calls_the_verify_function():
    """The core process cannot be counted from here: no module but the front calls verify_request."""
    callers = sorted(
        str(path.relative_to(RUNTIME))
        for path in RUNTIME.rglob("*.py")
        if "verify_request(" in path.read_text() and path.name != "sampling_params.py"
    )
    assert callers == ["engine/front.py"]

"""The toy proxy's request flow (vLLM tests/v1/kv_connector/nixl_integration/toy_proxy_server.py) against two
real `kvserve serve` processes on 127.0.0.1: a prefill server (kv_producer) and a decode server (kv_consumer),
the same random-weight demo model; the decode leg's answer equals the aggregated one (the prefill server
answering the plain request), streamed or not, completions and chat; then the prefill server is killed and a
decode leg still answers the same (its pull fails, it recomputes)."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("nixl_cu12", reason="P/D disaggregation needs NIXL: pip install 'kvserve[disagg]'")

from tests.disagg.pd_testing import free_port, transfer_config
from tests.server.serve_process import GroupServer

MAX_TOKENS = 16
PROMPT = "Once upon a time there was a little girl who lived in a village near the forest. " * 3
# The P leg as the toy proxy sends it: the remote fields present and null.
P_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("pd-cache"))
    side_port = free_port()
    p = GroupServer(cache, "--kv-transfer-config", transfer_config("kv_producer", "prefill-0", side_port))
    try:
        d = GroupServer(cache, "--kv-transfer-config", transfer_config("kv_consumer", "decode-0", handshake_timeout=2))
    except BaseException:
        p.kill()
        raise
    yield p, d
    p.kill()
    d.kill()


def _post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.base_url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream_text(server, path: str, body: dict, key) -> str:
    text = []
    with httpx.stream("POST", server.base_url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    text.append(key(choice) or "")
    return "".join(text)


def _completion(**extra) -> dict:
    return {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **extra}


def _prefill_leg(p, path: str, body: dict) -> dict:
    first = _post(p, path, {**body, "max_tokens": 1, "kv_transfer_params": P_PARAMS})
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "prefill-0"
    assert params["remote_host"] == "127.0.0.1" and isinstance(params["remote_block_ids"], list)
    return params


def test_completions_pd_equals_aggregated(servers):
    p, d = servers
    ref = _post(p, "/v1/completions", _completion())
    assert "kv_transfer_params" not in ref  # a plain request's response is unchanged
    params = _prefill_leg(p, "/v1/completions", _completion())
    out = _post(d, "/v1/completions", _completion(kv_transfer_params=params))
    assert out["choices"][0]["text"] == ref["choices"][0]["text"]
    assert out["usage"]["completion_tokens"] == MAX_TOKENS
    # Streaming on the decode leg (the toy proxy streams the D leg back to the client).
    params = _prefill_leg(p, "/v1/completions", _completion())
    streamed = _stream_text(d, "/v1/completions", _completion(kv_transfer_params=params), lambda c: c["text"])
    assert streamed == ref["choices"][0]["text"]


def test_chat_pd_equals_aggregated(servers):
    p, d = servers
    body = {
        "messages": [{"role": "user", "content": "Tell me a story about a dragon and a knight, please."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    ref = _post(p, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    params = _prefill_leg(p, "/v1/chat/completions", body)
    out = _post(d, "/v1/chat/completions", {**body, "kv_transfer_params": params})
    assert out["choices"][0]["message"]["content"] == ref
    params = _prefill_leg(p, "/v1/chat/completions", body)
    streamed = _stream_text(
        d, "/v1/chat/completions", {**body, "kv_transfer_params": params}, lambda c: c["delta"].get("content")
    )
    assert streamed == ref


def test_bad_kv_transfer_params_named(servers):
    _, d = servers
    r = httpx.post(
        d.base_url + "/v1/completions",
        json=_completion(kv_transfer_params={"do_remote_prefill": True, "remote_block_ids": "1,2"}),
        timeout=60,
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "kv_transfer_params.remote_block_ids"


def test_dead_prefill_server_decode_recomputes(servers):
    """Run last in this module: it kills the prefill server between the two legs."""
    p, d = servers
    ref = _post(p, "/v1/completions", _completion(prompt=PROMPT + " The end."))
    params = _prefill_leg(p, "/v1/completions", _completion(prompt=PROMPT + " The end."))
    p.kill()
    out = _post(d, "/v1/completions", _completion(prompt=PROMPT + " The end.", kv_transfer_params=params))
    assert out["choices"][0]["text"] == ref["choices"][0]["text"]


def test_bad_kv_transfer_config_exits_naming_the_field(tmp_path):
    import os
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1", "--port", str(free_port())]
        + [
            "--kv-cache-bytes",
            "32MiB",
            "--kv-transfer-config",
            '{"kv_connector": "NixlConnector", "kv_role": "prefill"}',
        ],
        env={**os.environ, "KVSERVE_CACHE_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode != 0
    assert "kv_transfer_config.kv_role must be one of kv_producer, kv_consumer, kv_both" in proc.stdout + proc.stderr

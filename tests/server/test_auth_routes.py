"""The API key guards every OpenAI route and nothing that probes or scrapers need (issue 15): checked over all
routes the app registers, so a route added later without check_auth() fails here. Also: `kvserve serve`
takes the key from KVSERVE_API_KEY, which is how operator-managed pods receive it (a secretKeyRef env)."""

from __future__ import annotations

import argparse
import logging

from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from kvserve.runtime.server.app import build_app
from kvserve.runtime.server.state import ServerConfig

OPEN = {"/health", "/ready", "/metrics"}
FASTAPI_DOCS = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}


def test_every_api_route_needs_the_key_and_probes_do_not():
    app = build_app(ServerConfig(served_model_names=["m"], api_key="s3cret"))  # no engine: loading
    routes = [(r.path, sorted(r.methods)[0]) for r in app.routes if isinstance(r, APIRoute)]
    api = [(p, m) for p, m in routes if p not in OPEN | FASTAPI_DOCS]
    assert {p for p, _ in api} >= {"/v1/models", "/v1/completions", "/v1/chat/completions"}
    # vLLM's own paths outside /v1: tokenisation, and sleep mode's (registered whatever the flag; 404 without it)
    outside_v1 = ("/tokenize", "/detokenize", "/sleep", "/wake_up", "/is_sleeping")
    assert all(p.startswith("/v1/") or p in outside_v1 for p, _ in api), api
    with TestClient(app) as client:
        for path, method in api:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                resp = client.request(method, path, json={}, headers=headers)
                assert resp.status_code == 401, (path, headers, resp.status_code)
                assert resp.json()["error"]["code"] == "invalid_api_key"
            ok = client.request(method, path, json={}, headers={"Authorization": "Bearer s3cret"})
            assert ok.status_code != 401, path  # past auth (503 loading, or 4xx on the empty body)
        assert client.get("/metrics").status_code == 200
        assert client.get("/health").status_code == 503  # loading, but answered without a key
        assert client.get("/ready").status_code == 503


def test_serve_reads_the_key_from_the_environment(monkeypatch, tmp_path):
    from kvserve.cli import serve

    (tmp_path / "config.json").write_text("{}")
    # serve.run configures root logging for a process; in a test process that would leave a handler on
    # pytest's captured stderr behind (closed after this test) for every later test's log records.
    monkeypatch.setattr(logging, "basicConfig", lambda **_: None)
    captured = {}
    from kvserve.runtime.server import api_server

    monkeypatch.setattr(api_server, "run_server", lambda config, **_: captured.setdefault("config", config) and 0)
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    monkeypatch.setenv("KVSERVE_API_KEY", "from-secret")
    serve.run(parser.parse_args([str(tmp_path)]))
    assert captured["config"].api_key == "from-secret"
    captured.clear()
    serve.run(parser.parse_args([str(tmp_path), "--api-key", "flag-wins"]))
    assert captured["config"].api_key == "flag-wins"

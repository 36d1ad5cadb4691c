"""--api-server-count N shares one port (SO_REUSEPORT): /health answered by a ready API server must stay 503
until every server of the group is ready, or a probe that passes sends traffic to a server still attaching
to the engine core (503s a client could not avoid). Each server marks itself ready in the group directory."""

from __future__ import annotations

from fastapi.testclient import TestClient

from kvserve.runtime.server.app import build_app
from kvserve.runtime.server.state import ServerConfig, _ready_marker


class _AwakeClient:  # the engine client's part the readiness check reads (EngineClient.sleeping)
    sleeping = False


class _RunningEngine:
    is_running = True
    num_in_flight = 0
    engine = _AwakeClient()


def test_health_waits_for_every_api_server_of_the_group(tmp_path):
    config = ServerConfig(served_model_names=["m"], api_server_index=0, api_server_count=2, group_dir=str(tmp_path))
    app = build_app(config)
    state = app.state.kvserve
    client = TestClient(app)  # no lifespan: the engine is set by hand below
    assert client.get("/health").status_code == 503
    state.engine = _RunningEngine()  # this server is ready ...
    open(_ready_marker(str(tmp_path), 0), "w").close()
    resp = client.get("/health")
    assert resp.status_code == 503 and resp.json()["status"] == "loading"  # ... server 1 is not
    open(_ready_marker(str(tmp_path), 1), "w").close()
    assert client.get("/health").status_code == 200
    assert client.get("/ready").status_code == 200


def test_a_single_server_needs_no_group():
    app = build_app(ServerConfig(served_model_names=["m"]))
    app.state.kvserve.engine = _RunningEngine()
    assert TestClient(app).get("/health").status_code == 200

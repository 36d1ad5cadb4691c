"""Live servers for the server tests: uvicorn on 127.0.0.1 (free port) in a background thread, serving the
demo model (built once per session into a temp dir) or examples/models/stories260K."""

from __future__ import annotations

import os
import socket
import threading
import time

import httpx
import pytest
from kvserve_testing import STORIES_DIR  # noqa: F401  (the server tests import it from here)

# `kvserve serve` with no model fetches the default model (runtime/default_model.py); the server tests run their
# no-model servers on the random-weights demo instead (tests/runtime/test_default_model.py tests the default).
os.environ.setdefault("KVSERVE_DEFAULT_MODEL", "demo")

# Small KV budget: the tests want preemption and a fast start, not capacity.
DEMO_ENGINE_KWARGS = dict(
    kv_cache_bytes=32 << 20, max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=1024, seed=0
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn serving build_app(...) in a thread. Not the main thread, so uvicorn installs no signal
    handlers; the SIGTERM path is tested on a subprocess instead."""

    def __init__(self, engine, **config_kwargs):
        import uvicorn

        from kvserve.runtime.server.app import build_app
        from kvserve.runtime.server.state import ServerConfig

        config_kwargs.setdefault("served_model_names", ["test-model"])
        config_kwargs.setdefault("log_interval_s", 1.0)
        self.config = ServerConfig(**config_kwargs)
        self.engine = engine
        self.app = build_app(self.config, engine=engine)
        self.state = self.app.state.kvserve
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.app,
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                lifespan="on",
                timeout_graceful_shutdown=5,
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("server did not become healthy")

    @property
    def model(self) -> str:
        return self.config.served_model_names[0]

    def openai(self, **kwargs):
        import openai

        return openai.OpenAI(
            base_url=self.base_url + "/v1",
            api_key=kwargs.pop("api_key", "unused"),
            max_retries=0,
            timeout=kwargs.pop("timeout", 60),
            **kwargs,
        )

    def async_openai(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(
            base_url=self.base_url + "/v1",
            api_key=kwargs.pop("api_key", "unused"),
            max_retries=0,
            timeout=kwargs.pop("timeout", 120),
            **kwargs,
        )

    def wait_idle(self, timeout_s: float = 20.0):
        """Wait until the engine has nothing in flight; returns its latest stats."""
        engine = self.state.engine
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            stats = engine.stats
            if (
                engine.num_in_flight == 0
                and stats is not None
                and stats.num_requests_running == 0
                and stats.num_requests_waiting == 0
                and engine._ops.empty()
            ):
                time.sleep(0.2)  # one more engine-loop turn refreshes the stats after the last abort
                return engine.stats
            time.sleep(0.05)
        raise AssertionError(
            f"engine not idle after {timeout_s}s: in_flight={engine.num_in_flight} stats={engine.stats}"
        )

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        if getattr(self.engine, "owns_core_process", False):
            self.engine.shutdown()  # the core process ends with its server (no orphans: checked per module)


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> str:
    from kvserve.runtime.demo_model import ensure_demo_model

    return str(ensure_demo_model(tmp_path_factory.mktemp("kvserve-cache")))


def make_engine(model_dir: str, *, in_process: bool = False, **overrides):
    """The engine a server test runs on: by default the engine core in its own process (what `kvserve serve`
    runs, core_client.CoreClient). in_process=True: an LLMEngine in the test process, for the tests that
    inject faults into the runner (engine.executor.execute = ...), which a process boundary would hide."""
    kwargs = {**DEMO_ENGINE_KWARGS, **overrides}
    if in_process:
        from kvserve.runtime.engine.llm_engine import LLMEngine

        return LLMEngine.from_kwargs(model=model_dir, **kwargs)
    from kvserve.runtime.engine.core_client import CoreClient

    return CoreClient.from_kwargs(model_dir, **kwargs)


@pytest.fixture(scope="session")
def offline_llm(demo_model_dir):
    """The offline engine on the same model: the reference the server's texts must equal."""
    from kvserve.runtime import LLM

    return LLM(model=demo_model_dir, **DEMO_ENGINE_KWARGS)


@pytest.fixture(scope="module")
def server(demo_model_dir):
    srv = LiveServer(make_engine(demo_model_dir), model_dir=demo_model_dir, random_weights=True)
    yield srv
    srv.stop()


def _live_descendants(root_pid: int | None = None) -> list[tuple[int, str]]:
    """(pid, command line) of every live process below this one, except multiprocessing's own helpers (the
    forkserver that starts engine cores, the resource tracker): those live as long as the test session."""
    import os

    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":  # a zombie is gone, only not yet reaped
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [(os.getpid() if root_pid is None else root_pid, "")]
    while todo:
        parent, parent_cmdline = todo.pop()
        for pid in children.get(parent, []):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            todo.append((pid, cmdline))
            # A process forked by the forkserver (an engine core) keeps the server's command line: only the
            # server itself, whose parent is not one, is a helper.
            helper = "multiprocessing.resource_tracker" in cmdline or (
                "multiprocessing.forkserver" in cmdline and "multiprocessing.forkserver" not in parent_cmdline
            )
            if not helper:
                found.append((pid, cmdline))
    return found


@pytest.fixture(scope="module", autouse=True)
def no_orphan_processes():
    """After each module's servers stopped: no engine-core process (or anything else the module started below
    this process) may be left running. Processes that were there before the module are not its own (in a
    whole-suite run: the node jsii runtime that importing the aws-cdk kubectl-layer package starts for the
    helm tests lives as long as the session)."""
    before = {pid for pid, _ in _live_descendants()}
    yield
    deadline = time.monotonic() + 15  # a core that was just told to stop gets its SHUTDOWN grace

    def left_by_module() -> list[tuple[int, str]]:
        return [(pid, cmdline) for pid, cmdline in _live_descendants() if pid not in before]

    while (left := left_by_module()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left running after the module: {left}"

"""A real redis-server (Debian's package) for the remote KV tier's tests: on 127.0.0.1 and a free port, no
persistence, an LRU cap like a deployment's, killed by the fixture and by `timeout` should the test process die.

Without the binary the tests fail, saying how to get it -- .ci/run installs it -- unless .ci/run could not
(KVSERVE_REDIS_UNAVAILABLE says why): then they skip with that reason, as tests/monitoring does for promtool.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

LIFETIME_S = 600  # the server stops itself after this long, whatever happens to the test process


def redis_server_binary() -> str:
    path = shutil.which("redis-server")
    if path is not None:
        return path
    why = os.environ.get("KVSERVE_REDIS_UNAVAILABLE")
    if why:
        pytest.skip(f"redis-server not installed: {why}")
    pytest.fail(
        "redis-server not found: install Debian's package (apt-get install --no-install-recommends redis-server; "
        ".ci/run does this in CI)",
        pytrace=False,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, maxmemory: str = "64mb"):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        args = ["--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no"]
        args += ["--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru", "--daemonize", "no"]
        self.proc = subprocess.Popen(
            ["timeout", str(LIFETIME_S), redis_server_binary(), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        import redis

        client = redis.Redis.from_url(self.url, socket_timeout=1)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"redis-server on port {self.port} did not start within {timeout_s} s")
                time.sleep(0.05)
        client.close()

    def client(self):
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=2)

    def _server_pid(self) -> int:
        """redis-server's pid (a child of `timeout`)."""
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
            return int(f.read().split()[0])

    def pause(self) -> None:
        """SIGSTOP: the socket stays open and nothing answers (a hung store: clients time out)."""
        os.kill(self._server_pid(), signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self._server_pid(), signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)

"""`kvserve serve` as a real subprocess leading its own process group (as under systemd, `timeout` or
supervisord's killasgroup), for the stop-signal and rolling-restart tests. Only 127.0.0.1; every wait is
bounded; kill() SIGKILLs the whole group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from tests.server.conftest import free_port


class GroupServer:
    """`kvserve serve` (the demo model) as the leader of its own process group."""

    def __init__(self, cache_dir: str, *extra: str, port: int | None = None, wait: bool = True):
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvserve.cli",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--kv-cache-bytes",
                "32MiB",
                "--max-model-len",
                "2048",
                "--drain-timeout",
                "60",
                *extra,
            ],
            env={**os.environ, "KVSERVE_CACHE_DIR": cache_dir},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.pgid = self.proc.pid  # start_new_session: the server leads its own group
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()
        if wait:
            self.wait_healthy()

    def wait_healthy(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.kill()
                raise AssertionError("server exited early:\n" + "".join(self.log))
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill()
        raise AssertionError("server never became healthy:\n" + "".join(self.log))

    def kill(self) -> None:
        """SIGKILL the whole group (the server and anything it left), then reap the server."""
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

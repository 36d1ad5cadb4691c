"""Process control for `kvserve bench peer`: each engine runs in its own session (process group), stopped on
exit and on errors (SIGTERM to the group, SIGKILL after a timeout); an OpenAI server is ready once /health
answers 200."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from kvserve.runtime.bench.cpu_pinning import pinned


def stop_process_group(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM to the process's group (it was started in its own session), SIGKILL after `timeout`."""
    if proc.poll() is not None:
        _kill_group(proc.pid, signal.SIGKILL)  # stragglers its children left
        return
    _kill_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid, signal.SIGKILL)
        proc.wait(10)
    _kill_group(proc.pid, signal.SIGKILL)


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def tail(path: str, n: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One engine's OpenAI server on 127.0.0.1 in its own session, pinned; ready once /health answers 200
    (vLLM listens only after its model is loaded and compiled). Stopped on exit, on errors too."""

    def __init__(
        self, engine: str, cmd: list[str], env: dict, cpus: list[int], port: int, log_path: str, ready_timeout: float
    ):
        self.engine, self.cmd, self.env, self.cpus, self.port = engine, cmd, env, cpus, port
        self.log_path, self.ready_timeout = log_path, ready_timeout
        self.base_url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Server":
        import urllib.error
        import urllib.request

        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
            # `python -m` puts the working directory first on sys.path: run from the log folder so no folder of
            # a kvserve checkout can shadow a package of the peer's venv.
            cwd=os.path.dirname(os.path.abspath(self.log_path)),
            preexec_fn=pinned(self.cpus),
            start_new_session=True,
        )
        t0 = time.monotonic()
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.engine} server exited with {self.proc.returncode} before it was ready; "
                        f"log {self.log_path}:\n{tail(self.log_path)}"
                    )
                if time.monotonic() - t0 > self.ready_timeout:
                    raise RuntimeError(
                        f"{self.engine} server not ready after {self.ready_timeout:.0f} s; log "
                        f"{self.log_path}:\n{tail(self.log_path)}"
                    )
                try:
                    with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                        if resp.status == 200:
                            break
                except (urllib.error.URLError, OSError):
                    pass
                time.sleep(0.5)
        except BaseException:
            self.__exit__()
            raise
        self.ready_s = time.monotonic() - t0
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            stop_process_group(self.proc)
        self._log.close()

"""Start-up and wake times of `kvserve serve` (issue 43), measured from outside as a user sees them: seconds from
launching the command until /health answers 200, and the seconds /wake_up takes after /sleep at each level.

    .venv/bin/python tools/measure_startup.py [--port 8765] [-- extra kvserve serve flags]

Runs, in order, each in fresh temporary directories (model cache = the demo model, CPU-ops build cache):
  cold_wait        fresh caches, KVSERVE_CPU_OPS_BUILD=wait: the old first start (the CPU ops built first)
  cold             fresh caches, the default (background build): the first start on a new machine/container
  warm             the caches `cold` left, once its background build finished: a restart
and on the warm server: /sleep and /wake_up at level 1 and level 2, and the first request after each wake.
Only 127.0.0.1; every wait is bounded; every server is stopped (SIGTERM, then SIGKILL to its process group).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

READY_TIMEOUT_S = 900.0
BUILD_TIMEOUT_S = 900.0


def start(port: int, env: dict, extra: list[str]) -> tuple[subprocess.Popen, float]:
    """Launch `kvserve serve`; (process, seconds until /health is 200)."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *extra],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    while time.monotonic() - started < READY_TIMEOUT_S:
        if proc.poll() is not None:
            raise RuntimeError(f"kvserve serve exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    stop(proc)
    raise RuntimeError("never ready")


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


def timed_post(url: str, **kwargs) -> float:
    started = time.monotonic()
    r = httpx.post(url, timeout=600, **kwargs)
    r.raise_for_status()
    return time.monotonic() - started


def phases(base: str) -> str:
    """The server's own start-up phases (kvserve:startup_phase_seconds), as one line."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=10).text):
        if family.name == "kvserve:startup_phase_seconds":
            return ", ".join(f"{s.labels['phase']} {s.value:.2f}" for s in family.samples)
    return "no phases exported"


def first_request_s(base: str) -> float:
    body = {"model": "kvserve-demo", "prompt": "hello", "max_tokens": 8, "temperature": 0}
    models = httpx.get(base + "/v1/models", timeout=10).json()["data"]
    body["model"] = models[0]["id"]
    return timed_post(base + "/v1/completions", json=body)


def wait_built(env: dict) -> float:
    """Seconds until the background build left a library in env's KVSERVE_CPU_OPS_DIR."""
    started = time.monotonic()
    code = "from kvserve.kernels import cpu_ops; import sys; sys.exit(0 if cpu_ops.is_built() else 1)"
    while time.monotonic() - started < BUILD_TIMEOUT_S:
        if subprocess.run([sys.executable, "-c", code], env=env).returncode == 0:
            return time.monotonic() - started
        time.sleep(2)
    raise RuntimeError("the background build did not finish")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("extra", nargs="*", help="extra `kvserve serve` flags (after --)")
    args = parser.parse_args()
    extra = ["--enable-sleep-mode", *args.extra]
    base = f"http://127.0.0.1:{args.port}"
    rows: list[tuple[str, float]] = []
    phase_lines: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:

        def env_for(name: str, mode: str | None) -> dict:
            env = {k: v for k, v in os.environ.items() if k != "KVSERVE_CPU_OPS_BUILD"}
            env.update(
                KVSERVE_CACHE_DIR=os.path.join(tmp, name, "models"), KVSERVE_CPU_OPS_DIR=os.path.join(tmp, name, "ops")
            )
            if mode:
                env["KVSERVE_CPU_OPS_BUILD"] = mode
            return env

        proc, seconds = start(args.port, env_for("old", "wait"), extra)
        rows.append(("cold start, fresh caches, build first (KVSERVE_CPU_OPS_BUILD=wait)", seconds))
        phase_lines.append("cold, build first: " + phases(base))
        stop(proc)
        env = env_for("new", None)
        proc, seconds = start(args.port, env, extra)
        rows.append(("cold start, fresh caches, background build (default)", seconds))
        phase_lines.append("cold, background build: " + phases(base))
        rows.append(("  first request on the pure-torch path", first_request_s(base)))
        stop(proc)
        rows.append(("  background build finished after the server stopped, further", wait_built(env)))
        proc, seconds = start(args.port, env, extra)
        rows.append(("warm restart (caches kept, compiled ops loaded)", seconds))
        phase_lines.append("warm restart: " + phases(base))
        try:
            rows.append(("  first request", first_request_s(base)))
            for level in (1, 2):
                rows.append((f"sleep level {level}", timed_post(base + "/sleep", params={"level": level})))
                rows.append((f"wake from level {level}", timed_post(base + "/wake_up")))
                rows.append((f"  first request after the level-{level} wake", first_request_s(base)))
        finally:
            stop(proc)
    width = max(len(name) for name, _ in rows)
    for name, seconds in rows:
        print(f"{name:<{width}}  {seconds:7.2f} s")
    print("start-up phases (s):", *phase_lines, sep="\n  ")
    return 0


if __name__ == "__main__":
    sys.exit(main())

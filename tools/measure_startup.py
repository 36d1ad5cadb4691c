"""Start-up and wake times of `kvserve serve` (issue 43), measured from outside as a user sees them: seconds from
launching the command until /health answers 200, and the seconds /wake_up takes after /sleep at each level.

    .venv/bin/python tools/measure_startup.py [--port 8765] [--runs 3] [--skip-build-first]
        [-- extra kvserve serve flags]

Runs, in order, each in fresh temporary directories (model cache, CPU-ops build cache):
  cold_wait        fresh caches, KVSERVE_CPU_OPS_BUILD=wait: the old first start (the CPU ops built first)
  cold x runs      fresh caches, the default (background build): the first start on a new machine/container;
                   each waits for its background build to finish before the next start
  warm x runs      the last cold run's caches: a restart; on each warm server /sleep and /wake_up at level 1
                   and 2, and the first request after each wake.
Prints the median of each (and every sample). Which model: as `kvserve serve` with no MODEL_DIR picks it, so
KVSERVE_DEFAULT_MODEL=demo measures the random-weights demo model, and without it the default model (its cold
runs then include its fetch, a local copy from pip's cache after the first).
Only 127.0.0.1; every wait is bounded; every server is stopped (SIGTERM, then SIGKILL to its process group).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
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
    parser.add_argument("--runs", type=int, default=3, help="starts of each kind; the table shows the median")
    parser.add_argument(
        "--skip-build-first", action="store_true", help="leave out cold_wait (the CPU-ops build before serving)"
    )
    parser.add_argument("extra", nargs="*", help="extra `kvserve serve` flags (after --)")
    args = parser.parse_args()
    extra = ["--enable-sleep-mode", *args.extra]
    base = f"http://127.0.0.1:{args.port}"
    samples: dict[str, list[float]] = {}
    phase_lines: list[str] = []

    def add(name: str, seconds: float) -> None:
        samples.setdefault(name, []).append(seconds)

    with tempfile.TemporaryDirectory() as tmp:

        def env_for(name: str, mode: str | None, ops_dir: str | None = None) -> dict:
            env = {k: v for k, v in os.environ.items() if k != "KVSERVE_CPU_OPS_BUILD"}
            env.update(
                KVSERVE_CACHE_DIR=os.path.join(tmp, name, "models"),
                KVSERVE_CPU_OPS_DIR=ops_dir or os.path.join(tmp, name, "ops"),
            )
            if mode:
                env["KVSERVE_CPU_OPS_BUILD"] = mode
            return env

        if not args.skip_build_first:
            proc, seconds = start(args.port, env_for("old", "wait"), extra)
            add("cold start, fresh caches, build first (KVSERVE_CPU_OPS_BUILD=wait)", seconds)
            phase_lines.append("cold, build first: " + phases(base))
            stop(proc)
        env = None
        for run in range(args.runs):
            env = env_for(f"new{run}", None)
            proc, seconds = start(args.port, env, extra)
            add("cold start, fresh caches, background build (default)", seconds)
            phase_lines.append(f"cold #{run}, background build: " + phases(base))
            add("  first request on the pure-torch path", first_request_s(base))
            stop(proc)
            # before the next start: a build still compiling would slow it (and is not a restart's cost)
            add("  background build finished after the server stopped, further", wait_built(env))
        for run in range(args.runs):
            proc, seconds = start(args.port, env, extra)
            add("warm restart (caches kept, compiled ops loaded)", seconds)
            phase_lines.append(f"warm #{run}: " + phases(base))
            try:
                add("  first request", first_request_s(base))
                for level in (1, 2):
                    add(f"sleep level {level}", timed_post(base + "/sleep", params={"level": level}))
                    add(f"wake from level {level}", timed_post(base + "/wake_up"))
                    add(f"  first request after the level-{level} wake", first_request_s(base))
            finally:
                stop(proc)
    width = max(len(name) for name in samples)
    print(f"median of {args.runs} (n = samples); load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for name, values in samples.items():
        runs = ", ".join(f"{v:.2f}" for v in values)
        print(f"{name:<{width}}  {statistics.median(values):7.2f} s  (n={len(values)}: {runs})")
    print("start-up phases (s):", *phase_lines, sep="\n  ")
    return 0


if __name__ == "__main__":
    sys.exit(main())

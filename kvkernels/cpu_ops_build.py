"""Building the compiled CPU ops out of the way of serving: ahead of time (`kvserve build-ops`, an image build) or
in a background process while the engine serves on the pure-torch path.

Why a separate process and not a thread: the build runs ninja and g++ for 20-100 s, and the Python side of a
thread would hold the GIL between their outputs and add a second `-fopenmp` world to the serving process; a
child process at a lower priority (nice 10) competes for the cores only through the OS scheduler. Why not
switch the running engine to the ops when the build finishes: the backend is fixed in the EngineConfig every
process was given, the model's fused element-wise ops are set when it is built, and in bf16 the two paths round
differently, so a request in flight would change arithmetic mid-answer. The next start loads the library
(kvkernels/cpu_ops.is_built) in about a second.

The build is the same `cpu_ops.load()` the engine calls, so torch's lock on the build directory (a second
builder waits), the stale-lock removal and the name hashes (a library of other sources or another CPU is never
loaded) all hold. `python -m kvserve.kernels.cpu_ops_build` runs one build and prints what it did.
"""

from __future__ import annotations

import os
import subprocess
import sys

from kvserve.kernels import cpu_ops

BUILD_MODE_ENV = "KVSERVE_CPU_OPS_BUILD"
BUILD_MODES = ("wait", "background")  # wait: build before serving (the library default); background: see above
BACKGROUND_NICE = 10  # the builder's niceness: serving keeps the cores when both want them
LOG_NAME = "background_build.log"


def build_mode(default: str = "wait") -> str:
    """$KVSERVE_CPU_OPS_BUILD, checked: 'wait' or 'background'."""
    mode = os.environ.get(BUILD_MODE_ENV, default)
    if mode not in BUILD_MODES:
        raise ValueError(f"{BUILD_MODE_ENV} must be one of {', '.join(BUILD_MODES)}, got {mode!r}")
    return mode


def build_in_progress(name: str | None = None) -> bool:
    """A builder holds the lock (stale locks, older than cpu_ops.STALE_LOCK_SECONDS, are cleared first)."""
    name = cpu_ops.extension_name() if name is None else name
    cpu_ops.clear_stale_build_lock(name)
    return os.path.exists(os.path.join(cpu_ops.build_directory(name), "lock"))


def start_background_build() -> tuple[subprocess.Popen | None, str]:
    """Start one builder process unless one already runs; (the process or None, its log path). The process
    outlives this one (its own session): a server stopped during the build still leaves a built library."""
    name = cpu_ops.extension_name()
    log_path = os.path.join(cpu_ops.build_directory(name), LOG_NAME)
    if build_in_progress(name):
        return None, log_path
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.kernels.cpu_ops_build", "--nice", str(BACKGROUND_NICE)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, BUILD_MODE_ENV: "wait"},
        )
    return proc, log_path


def build_now() -> tuple[bool, str]:
    """Build (or find built) and load the ops in this process: (usable, one line saying what happened)."""
    ok = cpu_ops.load()
    return ok, cpu_ops.describe() + (f" at {cpu_ops.library_path()}" if ok else "")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--nice"]:
        os.nice(int(args[1]))
    ok, line = build_now()
    print(line, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

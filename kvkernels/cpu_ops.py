"""The compiled kvserve CPU ops (sources in ``kvkernels/cpu/``), built on first use and cached.

:func:`load` builds ``kvkernels/cpu/*.cpp`` with ``torch.utils.cpp_extension.load`` as one lean shared library
(ATen + ``torch/library.h``, ``TORCH_LIBRARY``; no pybind, ``is_python_module=False``), flags
``-O3 -march=native -fopenmp -ffp-contract=off``. The library name carries an ISA tag plus a hash of the CPU's
feature flags, because torch's build cache key covers sources and flags but not the CPU ``-march=native``
compiled for, and a hash of the sources, so builds of different source versions never share a directory.
Builds land in torch's extension directory (``$TORCH_EXTENSIONS_DIR`` when set); torch's ``FileBaton`` lock in
that directory makes a second process wait for a build in progress instead of racing it.

When the build or the load fails (no compiler, no ninja, a non-CPU torch build...), :func:`load` returns
False and :func:`unavailable_reason` says why; callers fall back to pure torch. The ops, once loaded, are
``torch.ops.kvserve_cpu.*`` (fake implementations are registered, so torch.compile treats them as opaque):

* ``paged_attention(out, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, max_q_len)``
* ``store_kv(k, v, k_cache, v_cache, slot_mapping)``
* ``rms_norm(out, x, weight, eps)``, ``add_rms_norm(out, residual, x, weight, eps)``
* ``rotary_embedding(positions, q, k, cos, sin)`` (in place), ``silu_and_mul(out, x)``
* ``greedy_argmax(logits) -> int64 [rows]`` (torch.argmax(dim=-1) of float32 logits, vectorised)

Set ``KVSERVE_CPU_OPS=0`` to refuse loading (the pure-torch path then runs everywhere).
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import shutil
import sys
import time

_SRC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu")
_STATE: dict = {}
_OP_NAMES = (
    "paged_attention",
    "store_kv",
    "rms_norm",
    "add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "greedy_argmax",
)
_RETURNING_OPS = {"greedy_argmax"}  # the others write into their arguments and return nothing


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa_tag(flags: set[str] | None = None) -> str:
    """The widest path the kernels take on this CPU: 'avx512bf16', 'avx512', 'avx2' or 'generic'."""
    flags = cpu_flags() if flags is None else flags
    if {"avx512f", "avx512bw"} <= flags:
        return "avx512bf16" if "avx512_bf16" in flags else "avx512"
    return "avx2" if "avx2" in flags else "generic"


def sources_digest() -> str:
    """A hash of the C++ sources (names and bytes)."""
    h = hashlib.sha1()
    for path in sorted(glob.glob(os.path.join(_SRC_DIR, "*.cpp")) + glob.glob(os.path.join(_SRC_DIR, "*.h"))):
        h.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:8]


def extension_name(flags: set[str] | None = None) -> str:
    """kvserve_cpu_ops_<isa>_<cpu flags hash>_<sources hash>. The sources are in the name because torch's build
    directory is keyed by the name alone: two checkouts or versions of kvserve on one machine (a CI runner, a
    developer's worktrees, an upgrade) would otherwise rebuild over each other's library, and a process could
    load the other tree's build, lacking an op its Python side calls."""
    flags = cpu_flags() if flags is None else flags
    digest = hashlib.sha1(" ".join(sorted(flags)).encode()).hexdigest()[:8]
    return f"kvserve_cpu_ops_{isa_tag(flags)}_{digest}_{sources_digest()}"


def sources() -> list[str]:
    return sorted(glob.glob(os.path.join(_SRC_DIR, "*.cpp")))


def _ensure_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the PyPI `ninja` wheel may sit in a venv whose bin/ is not on PATH."""
    if shutil.which("ninja"):
        return
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja  # noqa: F401  (PyPI `ninja`)

        dirs.insert(0, ninja.BIN_DIR)
    except Exception:
        pass
    for d in dirs:
        if os.path.exists(os.path.join(d, "ninja")):
            os.environ["PATH"] = d + os.pathsep + os.environ.get("PATH", "")
            return


# A build of the ops takes 20-100 s; a lock older than this was left by a process killed mid-build.
STALE_LOCK_SECONDS = 600


def clear_stale_build_lock(name: str, now: float | None = None) -> bool:
    """Remove torch's build lock for `name` when it is older than STALE_LOCK_SECONDS; True when one was removed.

    torch's FileBaton waits, without a limit, for the `lock` file in the build directory to go away. A server
    killed while it compiled the ops (a Ctrl-C, a pod deleted during its first start) leaves that file behind,
    and every later start on the machine then hangs before loading the model (seen here: two processes stuck
    on a lock a killed test replica left)."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = os.path.join(_get_build_directory(name, False), "lock")
    try:
        age = (time.time() if now is None else now) - os.path.getmtime(lock)
    except OSError:
        return False
    if age <= STALE_LOCK_SECONDS:
        return False
    try:
        os.remove(lock)
    except OSError:
        return False
    logging.getLogger("kvserve.kernels").warning(
        "removed a stale build lock %s (%.0f s old: the build that took it was killed)", lock, age
    )
    return True


def _build() -> None:
    import torch
    from torch.utils.cpp_extension import load as cpp_load

    srcs = sources()
    if not srcs:
        raise RuntimeError(f"no C++ sources under {_SRC_DIR}")
    _ensure_ninja_on_path()
    name = extension_name()
    clear_stale_build_lock(name)
    cpp_load(
        name=name,
        sources=srcs,
        extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-DNDEBUG"],
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[_SRC_DIR],
        is_python_module=False,
        verbose=False,
    )
    for op in _OP_NAMES:
        if not hasattr(torch.ops.kvserve_cpu, op):
            raise RuntimeError(f"the extension loaded but torch.ops.kvserve_cpu.{op} is missing")
    _register_fakes()


def _register_fakes() -> None:
    import torch

    def _none(*args, **kwargs):
        return None

    def _argmax_fake(logits):
        return logits.new_empty(logits.shape[:1], dtype=torch.long)

    for op in _OP_NAMES:
        try:
            torch.library.register_fake(f"kvserve_cpu::{op}")(_argmax_fake if op in _RETURNING_OPS else _none)
        except Exception:  # already registered (a second load in one process) or an older torch
            pass


def load() -> bool:
    """Build (first time on this CPU) and load the ops; True when torch.ops.kvserve_cpu is usable. Never raises."""
    if "ok" in _STATE:
        return _STATE["ok"]
    if os.environ.get("KVSERVE_CPU_OPS", "1") == "0":
        _STATE.update(ok=False, reason="disabled by KVSERVE_CPU_OPS=0", seconds=0.0)
        return False
    t0 = time.perf_counter()
    try:
        _build()
        _STATE.update(ok=True, reason=None)
    except Exception as exc:  # no compiler, no ninja, a failed build or load: fall back to pure torch
        msg = str(exc).strip().splitlines()
        _STATE.update(ok=False, reason=f"{type(exc).__name__}: {msg[0] if msg else ''}"[:300])
    _STATE["seconds"] = time.perf_counter() - t0
    return _STATE["ok"]


def available() -> bool:
    return load()


def unavailable_reason() -> str | None:
    load()
    return _STATE.get("reason")


def describe() -> str:
    """One phrase for logs: which library and ISA path, or why the ops are unavailable."""
    if load():
        return f"compiled CPU ops {extension_name()} (ISA path {isa_tag()}, loaded in {_STATE['seconds']:.1f} s)"
    return f"compiled CPU ops unavailable ({_STATE['reason']})"

"""The compiled kvserve CPU ops (sources in ``kvkernels/cpu/``), built on first use and cached.

:func:`load` builds ``kvkernels/cpu/*.cpp`` with ``torch.utils.cpp_extension.load`` as one lean shared library
(ATen + ``torch/library.h``, ``TORCH_LIBRARY``; no pybind, ``is_python_module=False``), flags
``-O3 -march=native -fopenmp -ffp-contract=off``. The library name carries an ISA tag plus a hash of the CPU's
feature flags, because torch's build cache key covers sources and flags but not the CPU ``-march=native``
compiled for, and a hash of the sources, flags and torch version, so builds of different source versions never
share a directory. A library already built under this name is loaded directly (``torch.ops.load_library``, well
under a second), not through ninja's up-to-date check, which would rebuild for every checkout path.
Builds land in ``$KVSERVE_CPU_OPS_DIR/<name>/`` when that is set (a volume a pod keeps: the build then happens
once per node and CPU, not once per container), else in torch's extension directory (``$TORCH_EXTENSIONS_DIR``
when set); torch's ``FileBaton`` lock in that directory makes a second process wait for a build in progress
instead of racing it. :func:`is_built` says, without building, whether this CPU's library for these sources is
there (``kvserve build-ops`` builds it ahead of time; kvkernels/cpu_ops_build.py builds it in the background).

When the build or the load fails (no compiler, no ninja, a non-CPU torch build...), :func:`load` returns
False and :func:`unavailable_reason` says why; callers fall back to pure torch. The ops, once loaded, are
``torch.ops.kvserve_cpu.*`` (fake implementations are registered, so torch.compile treats them as opaque):

* ``paged_attention(out, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, max_q_len,
  max_fresh_q_len=-1, allow_amx=True, packed_kv=False)`` (bf16 on AMX tiles where the CPU has them:
  cpu/paged_attention_amx.cpp; packed_kv: the caches are in its AMX block layout, cpu/paged_attention_amx.h)
* ``store_kv(k, v, k_cache, v_cache, slot_mapping, packed_kv=False)``
* ``packed_kv_usable(head_dim, block_size) -> bool`` (this CPU, build and shape take the AMX block layout)
* ``rms_norm(out, x, weight, eps)``, ``add_rms_norm(out, residual, x, weight, eps)``
* ``rotary_embedding(positions, q, k, cos, sin)`` (in place), ``silu_and_mul(out, x)``
* ``greedy_argmax(logits) -> int64 [rows]`` (torch.argmax(dim=-1) of float32 / bf16 / fp16 logits, vectorised)
* ``screened_greedy_argmax(hidden, approx, weight, weight_norms) -> int64 [rows]`` (an fp32 LM head's greedy
  tokens from a bf16 screen: runtime/models/greedy_head.py)

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
    "screened_greedy_argmax",
    "packed_kv_usable",
    "panel_linear",
    "panel_linear_native",
)
_RETURNING_OPS = {"greedy_argmax", "screened_greedy_argmax"}  # the others write into their arguments and return nothing
# plain values in and out: nothing for torch.compile to trace
_NO_TENSOR_OPS = {"packed_kv_usable", "panel_linear_native"}


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


# Tuples: torch's load() edits the lists it is given, which would change the name's hash mid-process.
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-DNDEBUG")
_LDFLAGS = ("-fopenmp",)


def _torch_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "unknown"


def sources_digest() -> str:
    """A hash of what decides the built library besides the CPU: the C++ sources (names and bytes), the
    compiler flags and the torch version it links against. A built library whose name matches is therefore
    loaded as it is (no ninja check: worktrees or images at other paths would rewrite build.ninja and rebuild)."""
    h = hashlib.sha1()
    h.update(" ".join(_CFLAGS + _LDFLAGS).encode())
    h.update(_torch_version().encode())
    for path in sorted(glob.glob(os.path.join(_SRC_DIR, "*.cpp")) + glob.glob(os.path.join(_SRC_DIR, "*.h"))):
        h.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:8]


def extension_name(flags: set[str] | None = None) -> str:
    """kvserve_cpu_ops_<isa>_<cpu flags hash>_<sources_digest>. The sources are in the name because torch's build
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


BUILD_DIR_ENV = "KVSERVE_CPU_OPS_DIR"  # where builds go (a pod's volume); unset: torch's extension directory


def build_directory(name: str | None = None) -> str:
    """The directory `name`'s build lives in (created if missing): $KVSERVE_CPU_OPS_DIR/<name>, else torch's."""
    name = extension_name() if name is None else name
    root = os.environ.get(BUILD_DIR_ENV)
    if root:
        path = os.path.join(os.path.abspath(root), name)
        os.makedirs(path, exist_ok=True)
        return path
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(name, False)


def library_path(name: str | None = None) -> str:
    name = extension_name() if name is None else name
    return os.path.join(build_directory(name), f"{name}.so")


def is_built(name: str | None = None) -> bool:
    """Whether this CPU's library for these sources is built and no build holds its lock: loading it then
    takes a ninja no-op check, not a compile. A library of other sources or another CPU has another name (the
    hashes in extension_name), so it never counts. A fresh lock means a build in progress (not built yet)."""
    name = extension_name() if name is None else name
    directory = build_directory(name)
    return os.path.exists(os.path.join(directory, f"{name}.so")) and not os.path.exists(os.path.join(directory, "lock"))


def enabled() -> bool:
    """False when KVSERVE_CPU_OPS=0 refuses the library."""
    return os.environ.get("KVSERVE_CPU_OPS", "1") != "0"


# A build of the ops takes 20-100 s; a lock older than this was left by a process killed mid-build.
STALE_LOCK_SECONDS = 600


def clear_stale_build_lock(name: str, now: float | None = None) -> bool:
    """Remove torch's build lock for `name` when it is older than STALE_LOCK_SECONDS; True when one was removed.

    torch's FileBaton waits, without a limit, for the `lock` file in the build directory to go away. A server
    killed while it compiled the ops (a Ctrl-C, a pod deleted during its first start) leaves that file behind,
    and every later start on the machine then hangs before loading the model (seen here: two processes stuck
    on a lock a killed test replica left)."""
    lock = os.path.join(build_directory(name), "lock")
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
    loaded = False
    if is_built(name):  # the name covers sources, flags, torch and CPU: load it without asking ninja
        try:
            torch.ops.load_library(library_path(name))
            loaded = True
        except (OSError, RuntimeError) as exc:  # a truncated library (a build killed mid-link): build again
            logging.getLogger("kvserve.kernels").warning("rebuilding %s: loading it failed (%s)", name, exc)
    if not loaded:
        cpp_load(
            name=name,
            sources=srcs,
            extra_cflags=list(_CFLAGS),
            extra_ldflags=list(_LDFLAGS),
            extra_include_paths=[_SRC_DIR],
            build_directory=build_directory(name),
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

    def _argmax_fake(rows, *args):  # one int64 per row of the first argument
        return rows.new_empty(rows.shape[:1], dtype=torch.long)

    for op in _OP_NAMES:
        if op in _NO_TENSOR_OPS:
            continue
        try:
            torch.library.register_fake(f"kvserve_cpu::{op}")(_argmax_fake if op in _RETURNING_OPS else _none)
        except Exception:  # already registered (a second load in one process) or an older torch
            pass


def load() -> bool:
    """Build (first time on this CPU) and load the ops; True when torch.ops.kvserve_cpu is usable. Never raises."""
    if "ok" in _STATE:
        return _STATE["ok"]
    if not enabled():
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


def load_seconds() -> float | None:
    """Seconds load() spent in this process (a build, or the check and load of a built library); None when
    load() never ran here."""
    return _STATE.get("seconds")


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

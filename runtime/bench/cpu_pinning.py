"""CPU pinning for `kvserve bench peer`: CPU lists ("0-1,3"), which cores the engines and the client get, a
pre-exec hook that pins a child process, and what the machine and its load were during a run."""

from __future__ import annotations

import os
import sys


def parse_cpus(text: str) -> list[int]:
    """ "0-1,3" -> [0, 1, 3] (sorted, unique); ValueError on anything else."""
    cpus: set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"not a CPU list: {text!r} (examples: 0, 0-1, 0,2-3)") from None
        if a < 0 or b < a:
            raise ValueError(f"not a CPU list: {text!r} (examples: 0, 0-1, 0,2-3)")
        cpus.update(range(a, b + 1))
    if not cpus:
        raise ValueError(f"empty CPU list: {text!r}")
    return sorted(cpus)


def format_cpus(cpus: list[int]) -> str:
    """[0, 1, 3] -> "0-1,3" (the form VLLM_CPU_OMP_THREADS_BIND and taskset take)."""
    parts, start = [], None
    cpus = sorted(set(cpus))
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            parts.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(parts)


def default_cpus(mode: str, available: list[int]) -> tuple[list[int], list[int]]:
    """(engine cores, client cores). Offline: every core for the engine. Served with 2+ cores: the engine
    servers get all but the first core and the client gets the first, so the client's own per-chunk work does
    not come out of the server's cores (the issue's served table: each server on 1 core of 2)."""
    available = sorted(available)
    if mode == "served" and len(available) >= 2:
        return available[1:], available[:1]
    return available, available


def pinned(cpus: list[int]):
    def preexec() -> None:
        os.sched_setaffinity(0, cpus)

    return preexec


def load_average() -> float:
    return os.getloadavg()[0]


def machine_info() -> dict:
    info = {"cpus_available": format_cpus(sorted(os.sched_getaffinity(0))), "python": sys.version.split()[0]}
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "")
        flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
        info["cpu_model"] = model
        info["cpu_flags"] = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma"))
    except OSError:
        pass
    return info

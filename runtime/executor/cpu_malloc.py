"""glibc malloc settings for a CPU engine: keep freed tensor memory for the next step instead of unmapping it.

A CPU step allocates and frees the same large tensors every time (activations, logits, attention
scratch: hundreds of KiB to tens of MiB each). glibc serves a block above its mmap threshold (128 KiB,
raised dynamically only up to 32 MiB) with a fresh mmap and unmaps it on free, so every step pays the page
faults of touching new pages again, and trims the heap top back to the kernel above 128 KiB free. Measured
on the 2-core EPYC (offline bf16, the 125M peer-benchmark model): ~235k minor faults and 1.6-1.8 s of
system time per 48-request run by default, ~1k faults and 0.1 s with the thresholds below; `kvserve bench
peer --engines kvserve` on a quiet machine, 404 -> 465 output tok/s (+15%, docs/performance.md). vLLM gets
the same effect by preloading tcmalloc in its CPU images.

So on Linux/glibc the CPU model runner raises the mmap threshold to 1 GiB (blocks below it come from the
heap and are reused) and the trim threshold to 2 GiB (freed memory stays mapped): the process keeps its
peak step memory instead of returning it between steps, which a serving process reaches again every step
anyway. Set once per process, before the model loads; a process that chose its allocator (LD_PRELOAD of
tcmalloc/jemalloc, MALLOC_*_ / GLIBC_TUNABLES malloc settings) is left alone, and
KVSERVE_CPU_MALLOC_TUNING=0 turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys

logger = logging.getLogger("kvserve.executor")

MMAP_THRESHOLD_BYTES = 1 << 30  # above any single step tensor of a CPU-sized model; the KV cache is allocated once
TRIM_THRESHOLD_BYTES = (1 << 31) - 1  # mallopt takes an int: the largest it accepts, ~2 GiB
_M_TRIM_THRESHOLD = -1  # <malloc.h>
_M_MMAP_THRESHOLD = -3

_applied: str | None = None  # what this process did (set once)


def allocator_chosen_by_user(environ=os.environ) -> str | None:
    """Why the process's allocator settings are the user's (None: they are glibc's defaults)."""
    preload = environ.get("LD_PRELOAD", "")
    for name in ("tcmalloc", "jemalloc", "mimalloc"):
        if name in preload:
            return f"LD_PRELOAD has {name}"
    for var in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_"):
        if var in environ:
            return f"{var} is set"
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES has malloc settings"
    return None


def tune_for_cpu_steps() -> str:
    """Apply the thresholds once per process; returns (and logs, the first time) what was done."""
    global _applied
    if _applied is not None:
        return _applied
    if os.environ.get("KVSERVE_CPU_MALLOC_TUNING", "1") == "0":
        _applied = "off (KVSERVE_CPU_MALLOC_TUNING=0)"
    elif not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        _applied = "not glibc: left as it is"
    elif (reason := allocator_chosen_by_user()) is not None:
        _applied = f"left as it is ({reason})"
    else:
        libc = ctypes.CDLL(None)  # the process's own libc (glibc here)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and libc.mallopt(
            _M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES
        )
        _applied = (
            "mmap threshold 1 GiB, trim threshold 2 GiB (step tensors reuse freed memory; "
            "KVSERVE_CPU_MALLOC_TUNING=0 turns this off)"
            if ok
            else "mallopt refused the thresholds: left as it is"
        )
    logger.info("glibc malloc for CPU steps: %s", _applied)
    return _applied


HUGE_PAGE_BYTES = 2 << 20  # x86-64 / arm64 transparent huge page size
_MADV_HUGEPAGE = 14  # <sys/mman.h>


def advise_huge_pages(tensor) -> int:
    """Ask the kernel to back `tensor` (a CPU tensor not yet touched) with transparent huge pages; returns the
    bytes advised (0: not Linux, switched off, too small, or refused).

    Why: decode attention reads each sequence's KV blocks from wherever the block table points, hundreds of MiB
    per step across the layers; with 4 KiB pages nearly every block visit is a TLB miss and a page walk. With
    THP in its common `madvise` mode (the default of many distributions, and this machine's) a mapping gets huge
    pages only if asked, so the CPU model runner asks for the KV cache before zeroing it (the first touch is
    when the kernel picks the page size). Measured on the 2-core EPYC, 12 layers of paged decode attention
    (128 sequences, bf16), interleaved A/B in one process: 10-20% less time (docs/performance.md).
    KVSERVE_CPU_HUGEPAGES=0 turns this off."""
    if os.environ.get("KVSERVE_CPU_HUGEPAGES", "1") == "0" or not sys.platform.startswith("linux"):
        return 0
    if tensor.device.type != "cpu":
        return 0
    ptr, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    start = (ptr + HUGE_PAGE_BYTES - 1) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    end = (ptr + size) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if end <= start:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.madvise(start, end - start, _MADV_HUGEPAGE) != 0:  # THP compiled out, or `never`: nothing lost
        logger.info("madvise(MADV_HUGEPAGE) refused (errno %d): the KV cache uses 4 KiB pages", ctypes.get_errno())
        return 0
    return end - start


def zeroed_cpu_tensor(shape: tuple[int, ...], dtype):
    """A zero-filled CPU tensor backed by its own anonymous mapping (advised for huge pages before any touch).

    Why not torch.zeros: zeroing the default 1 GiB KV cache wrote every page at start-up (0.4-0.6 s of the
    start, issue 43) although the kernel hands out anonymous pages zero-filled anyway, and most blocks are not
    used for minutes. Here each page is zeroed by the kernel when first touched. The mapping is freed with the
    tensor (torch.frombuffer holds the mmap object)."""
    import mmap

    import torch

    numel = 1
    for dim in shape:
        numel *= dim
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)
    advise_huge_pages(tensor)
    return tensor

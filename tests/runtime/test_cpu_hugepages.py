"""The CPU model runner asks for transparent huge pages for the KV cache (cpu_malloc.advise_huge_pages): the
mapping that holds the advised range becomes THP-eligible in the kernel's view (/proc/self/smaps), where an
unadvised one is not under THP's `madvise` mode; the switch and the too-small case advise nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvserve.runtime.executor.cpu_malloc import HUGE_PAGE_BYTES, advise_huge_pages


def _thp_mode() -> str | None:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or _thp_mode() in (None, "never"), reason="Linux with THP available"
)

# Run in a fresh process: with glibc's default mmap threshold each 64 MiB tensor is its own untouched mapping,
# not heap memory that an earlier test of this worker advised (an engine raises the threshold to 1 GiB).
PROBE = r"""
import torch
from kvserve.runtime.executor.cpu_malloc import HUGE_PAGE_BYTES, advise_huge_pages

def thp_eligible(ptr):
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    raise SystemExit(f"no mapping holds {ptr:#x}")

plain, advised = torch.empty(64 << 20, dtype=torch.uint8), torch.empty(64 << 20, dtype=torch.uint8)
nbytes = advise_huge_pages(advised)
plain.zero_(), advised.zero_()
start = (advised.data_ptr() + HUGE_PAGE_BYTES - 1) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
print("RESULT", nbytes, thp_eligible(start), thp_eligible(plain.data_ptr() + HUGE_PAGE_BYTES))
"""


def _probe() -> tuple[int, bool, bool]:
    """(bytes advised, the advised tensor's mapping eligible, the plain tensor's mapping eligible)."""
    env = {k: v for k, v in os.environ.items() if k != "KVSERVE_CPU_HUGEPAGES"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    nbytes, advised, plain = out.stdout.split("RESULT", 1)[1].split()[:3]
    return int(nbytes), advised == "True", plain == "True"


def test_advised_kv_sized_tensor_is_thp_eligible():
    nbytes, advised, _ = _probe()
    assert nbytes >= (64 << 20) - 2 * HUGE_PAGE_BYTES and nbytes % HUGE_PAGE_BYTES == 0
    assert advised


@pytest.mark.skipif(_thp_mode() != "madvise", reason="the control needs THP's madvise mode")
def test_unadvised_tensor_is_not_thp_eligible():
    assert not _probe()[2]


def test_switch_and_small_tensors_advise_nothing(monkeypatch):
    assert advise_huge_pages(torch.empty(HUGE_PAGE_BYTES // 2, dtype=torch.uint8)) == 0
    monkeypatch.setenv("KVSERVE_CPU_HUGEPAGES", "0")
    assert advise_huge_pages(torch.empty(64 << 20, dtype=torch.uint8)) == 0

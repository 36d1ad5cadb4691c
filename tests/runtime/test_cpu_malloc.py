"""The CPU model runner tunes glibc malloc (runtime/executor/cpu_malloc.py): after an engine is built on CPU,
freeing and re-allocating step-sized tensors touches no new pages; in a process with no engine (glibc's
defaults) the same loop page-faults on every allocation. Run in subprocesses: the setting is per process."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from kvserve.runtime.executor.cpu_malloc import allocator_chosen_by_user

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc malloc only"
)

PROBE = r"""
import logging, resource, sys, torch
logging.basicConfig(level=logging.INFO)
from kvserve.runtime import LLM
llm = LLM(sys.argv[1], max_model_len=64, num_kv_blocks=16, block_size=16) if sys.argv[1] != "-" else None
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        t = torch.empty(48 << 20, dtype=torch.uint8)
        t.fill_(1)  # touch every page
        del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults()  # the first round may grow the heap
print("FAULTS", faults())
if llm is not None:
    llm.shutdown()
"""


def probe(model_dir: str, **env: str) -> tuple[int, str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, model_dir],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("FAULTS"))
    return int(line.split()[1]), out.stderr


def test_engine_on_cpu_reuses_freed_step_memory(model_factory):
    model_dir = model_factory("llama_gqa")[0]
    tuned, log = probe(model_dir)
    assert "glibc malloc for CPU steps: mmap threshold 1 GiB" in log, log
    default, _ = probe("-")  # no engine: glibc's defaults
    pages = 10 * (48 << 20) // 4096
    assert default > pages // 2  # glibc's default: a fresh mmap per 48 MiB tensor, every page faulted again
    assert tuned < pages // 20, (tuned, default)


def test_the_switch_turns_it_off(monkeypatch):
    from kvserve.runtime.executor import cpu_malloc

    monkeypatch.setattr(cpu_malloc, "_applied", None)
    monkeypatch.setenv("KVSERVE_CPU_MALLOC_TUNING", "0")
    assert cpu_malloc.tune_for_cpu_steps() == "off (KVSERVE_CPU_MALLOC_TUNING=0)"


def test_a_user_chosen_allocator_is_left_alone():
    assert allocator_chosen_by_user({}) is None
    assert allocator_chosen_by_user({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}) == "LD_PRELOAD has tcmalloc"
    assert allocator_chosen_by_user({"MALLOC_MMAP_THRESHOLD_": "65536"}) == "MALLOC_MMAP_THRESHOLD_ is set"
    assert allocator_chosen_by_user({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}) is not None
    assert allocator_chosen_by_user({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F"}) is None

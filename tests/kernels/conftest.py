"""Kernel tests run on CPU tensors under the Triton interpreter.

``TRITON_INTERPRET=1`` is set for each test here through ``monkeypatch`` (an autouse fixture) and removed
afterwards, so it does not leak into other test directories run in the same process (a runtime that picked
its default backend from it would otherwise slow down). That is enough because triton 3.x decides between
compiler and interpreter when ``@triton.jit`` decorates, but our kernels are wrapped by
kvserve.kernels._triton_utils.LazyKernel, which reads the variable at *launch* time; so import order does
not matter (test_interpret_env_read_at_launch checks that in a fresh interpreter).

Inputs are fresh random each run: the seed comes from os.urandom unless KVSERVE_KERNEL_SEED is set, and is
printed in every failure message (rerun with KVSERVE_KERNEL_SEED=<seed> to reproduce).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

_missing = [m for m in ("torch", "triton") if importlib.util.find_spec(m) is None]
if _missing:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def seed(request) -> int:
    env = os.environ.get("KVSERVE_KERNEL_SEED")
    value = int(env) if env else int.from_bytes(os.urandom(4), "little")
    return value


@pytest.fixture
def gen(seed):
    import torch

    g = torch.Generator()
    g.manual_seed(seed)
    return g

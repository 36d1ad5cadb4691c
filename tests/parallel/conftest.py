"""Tensor-parallel tests: random-weight models built here from a config (no hub), workers on gloo/CPU.

Every test must leave no worker process behind; the autouse fixture below checks that after each test."""

from __future__ import annotations

import multiprocessing
import time

import pytest


@pytest.fixture(scope="session")
def tp_model_factory(tmp_path_factory):
    """tp_model_factory(name) -> (model_dir, hf_model), built once per session."""
    from kvserve_testing import TEST_MODEL_CONFIGS

    from kvserve.runtime.models.synthetic import make_random_model_dir

    cache: dict = {}

    def build(name: str):
        if name not in cache:
            arch, kwargs = TEST_MODEL_CONFIGS[name]
            out = str(tmp_path_factory.mktemp(f"tp-{name}"))
            cache[name] = (out, make_random_model_dir(out, arch, seed=1234, **kwargs))
        return cache[name]

    return build


def _live_workers() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("kvserve-tp-rank")]


@pytest.fixture(autouse=True)
def no_orphan_workers():
    yield
    deadline = time.monotonic() + 10
    while _live_workers() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _live_workers()
    for p in left:  # do not let one failure leak processes into the rest of the session
        p.kill()
    assert not left, f"tensor-parallel workers left running: {left}"

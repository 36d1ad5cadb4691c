"""Shared fixtures: small random-weight models (built here from a config, no hub) and HF references."""

from __future__ import annotations

import os

import pytest
from kvserve_testing import STORIES_DIR

SHARED_STORIES = str(STORIES_DIR)  # in the repository: examples/models/stories260K


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """model_factory(name) -> (model_dir, hf_model); built once per session."""
    from kvserve_testing import TEST_MODEL_CONFIGS

    from kvserve.runtime.models.synthetic import make_random_model_dir

    cache: dict = {}

    def build(name: str, dtype: str = "float32"):
        key = (name, dtype)
        if key not in cache:
            arch, kwargs = TEST_MODEL_CONFIGS[name]
            out = str(tmp_path_factory.mktemp(f"{name}-{dtype}"))
            cache[key] = (out, make_random_model_dir(out, arch, seed=1234, dtype=dtype, **kwargs))
        return cache[key]

    return build


@pytest.fixture(scope="session")
def stories_dir():
    return os.path.abspath(SHARED_STORIES)

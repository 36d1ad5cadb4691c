"""Fixtures of the operator's tests: `apiserver`, a real Kubernetes API server for custom resources
(tests/operator/apiserver.py), started once per test process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.operator import apiserver as apiserver_mod


@pytest.fixture(scope="session")
def apiserver() -> Iterator[apiserver_mod.ApiServer]:
    yield from apiserver_mod.session_fixture()

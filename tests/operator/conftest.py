"""Fixtures of the operator's tests: a real Kubernetes API server for custom resources (tests/operator/apiserver.py),
started once per test process, with the InferenceService CRD installed, and `admit`, which asks it."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import pytest
import yaml

from tests.operator import apiserver as apiserver_mod

CRD_PATH = pathlib.Path(__file__).resolve().parents[2] / "crds" / "inferenceservices.serving.kvserve.dev.yaml"
NAMESPACE = "kvserve-test"  # the server has no Namespace kind (nor NamespaceLifecycle): any name is fine


class Refused(ValueError):
    """The API server refused an object (HTTP 422, or 400 for an unknown field); the message is its own."""


@pytest.fixture(scope="session")
def apiserver() -> apiserver_mod.ApiServer:
    return apiserver_mod.shared()


@pytest.fixture(scope="session")
def crd_server(apiserver: apiserver_mod.ApiServer) -> apiserver_mod.ApiServer:
    """The real server with crds/'s InferenceService CRD installed."""
    apiserver.apply_crd(yaml.safe_load(CRD_PATH.read_text()))
    return apiserver


def create(server: apiserver_mod.ApiServer, obj: dict, plural: str, dry_run: bool = True) -> dict:
    """POST `obj` under strict field validation (unknown fields refused, as `kubectl apply` does); returns what
    the server stores (defaults applied). Raises Refused with the server's message."""
    query = {"fieldValidation": "Strict", **({"dryRun": "All"} if dry_run else {})}
    namespace = obj["metadata"].get("namespace") or NAMESPACE
    path = server.collection(obj["apiVersion"], plural, namespace)
    try:
        return server.request("POST", path, obj, query=query)
    except apiserver_mod.ApiError as exc:
        if exc.status == 422 or (exc.status == 400 and "unknown field" in exc.message):
            raise Refused(exc.message) from None
        raise


@pytest.fixture()
def admit(crd_server: apiserver_mod.ApiServer) -> Callable[[dict], dict]:
    """admit(InferenceService) -> the object the real server would store (a dry-run create); raises Refused."""
    from kvserve.operator import spec as spec_mod

    return lambda obj: create(crd_server, obj, spec_mod.PLURAL)


@pytest.fixture()
def upstream_admit(crd_server: apiserver_mod.ApiServer) -> Callable[[dict], dict]:
    """upstream_admit(obj) for a LeaderWorkerSet, ScaledObject or InferencePool: a dry-run create against its
    vendored CRD (installed on first use) in the real server; raises Refused."""
    from tests.operator import upstream_crds

    for crd in upstream_crds.crds():
        if crd["metadata"]["name"] not in _installed:
            crd_server.apply_crd(crd)
            _installed.add(crd["metadata"]["name"])
    return lambda obj: create(crd_server, obj, upstream_crds.plural(obj["apiVersion"], obj["kind"]))


_installed: set[str] = set()

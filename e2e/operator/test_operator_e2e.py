"""End to end: kopf running kvserve's handlers against kmock's KubernetesEmulator (see conftest.py)."""
from __future__ import annotations

import copy
import pathlib
import time

import pytest
import yaml
from kopf.testing import KopfRunner


ROOT = pathlib.Path(__file__).resolve().parents[2]
NS = "default"
pytestmark = pytest.mark.timeout(120)


def _example(name: str = "llama70b.yaml") -> dict:
    obj = yaml.safe_load((ROOT / "examples" / name).read_text())
    # What the API server would add; the emulator does not.
    obj["metadata"].update(uid=f"uid-{obj['metadata']['name']}", generation=1, resourceVersion="1")
    return obj


def _runner() -> KopfRunner:
    return KopfRunner(["run", "--standalone", "--all-namespaces", "--verbose", "-m", "kvserve.operator.handlers"],
                      timeout=30)


def test_smoke(emulator):
    body = _example()
    with _runner() as runner:
        emulator.call("POST", emulator.path(emulator.CR, NS), body)
        dep = emulator.wait_for(lambda: emulator.get(emulator.CHILDREN["Deployment"], NS, "llama70b"), what="deployment")
        time.sleep(2)
        print(emulator.get(emulator.CR, NS, "llama70b"))
    open("/tmp/kopf_out.txt", "w").write(runner.output)

"""Issues 40 and 41 end to end: kopf + the handlers against kmock. Scaling the router to two replicas rolls the
KV-event wiring into the engine, the router and the NetworkPolicy; spec.kvCache.offload puts the host tier in
the engine's memory request and its figures in status.kvOffload."""

from __future__ import annotations

import pathlib

import pytest
import yaml
from kopf.testing import KopfRunner

from kvserve.operator import labels

ROOT = pathlib.Path(__file__).resolve().parents[2]
NS, NAME, ROUTER = "default", "llama70b", "llama70b-router"
pytestmark = pytest.mark.timeout(90)
GiB = 1 << 30


def _runner() -> KopfRunner:
    return KopfRunner(["run", "--standalone", "--all-namespaces", "-m", "kvserve.operator.handlers"], timeout=30)


def _example(**spec) -> dict:
    obj = yaml.safe_load((ROOT / "examples" / "llama70b.yaml").read_text())
    obj["metadata"].update(uid="uid-llama70b", generation=1, resourceVersion="1")
    obj["spec"].pop("resources", None)
    obj["spec"].update(spec)
    return obj


def _command(dep: dict | None) -> list[str]:
    return (dep or {}).get("spec", {}).get("template", {}).get("spec", {}).get("containers", [{}])[0].get("command", [])


def test_a_second_router_replica_wires_the_kv_events(emulator):
    def engine():
        return emulator.get(emulator.CHILDREN["Deployment"], NS, NAME)

    def router():
        return emulator.get(emulator.CHILDREN["Deployment"], NS, ROUTER)

    def policy_ports():
        policy = emulator.get(emulator.CHILDREN["NetworkPolicy"], NS, NAME) or {"spec": {"ingress": []}}
        return {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}

    with _runner() as runner:
        emulator.call("POST", emulator.path(emulator.CR, NS), _example(router={"enabled": True}))
        emulator.wait_for(lambda: router() is not None and engine() is not None, what="engine and router")
        emulator.wait_for(lambda: policy_ports(), what="the NetworkPolicy")
        assert "--kv-events-config" not in _command(engine()) and 5557 not in policy_ports()
        emulator.call(
            "PATCH",
            emulator.path(emulator.CR, NS, NAME),
            {"metadata": {"generation": 2}, "spec": {"router": {"replicas": 2}}},
            content_type="application/merge-patch+json",
        )
        emulator.wait_for(lambda: "--kv-events-port" in _command(router()), what="the router subscribing")
        emulator.wait_for(lambda: "--kv-events-config" in _command(engine()), what="the engine publishing")
        emulator.wait_for(lambda: {5557, 5558} <= policy_ports(), what="the event ports open to the routers")
        assert router()["spec"]["replicas"] == 2
        policy = emulator.get(emulator.CHILDREN["NetworkPolicy"], NS, NAME)
        (rule,) = [r for r in policy["spec"]["ingress"] if {p["port"] for p in r["ports"]} == {5557, 5558}]
        assert rule["from"] == [{"podSelector": {"matchLabels": labels.router_selector(NAME)}}]
    assert runner.exit_code == 0 and runner.exception is None
    assert "Traceback" not in runner.output, runner.output[-3000:]


def test_the_host_tier_reaches_the_memory_request_and_the_status(emulator):
    def cr():
        return emulator.get(emulator.CR, NS, NAME) or {}

    def memory():
        dep = emulator.get(emulator.CHILDREN["Deployment"], NS, NAME)
        return dep["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["memory"] if dep else None

    with _runner() as runner:
        emulator.call("POST", emulator.path(emulator.CR, NS), _example())
        emulator.wait_for(memory, what="the engine Deployment")
        before = int(memory().removesuffix("Mi"))
        emulator.call(
            "PATCH",
            emulator.path(emulator.CR, NS, NAME),
            {"metadata": {"generation": 2}, "spec": {"kvCache": {"offload": {"hostSizeGiB": 32}}}},
            content_type="application/merge-patch+json",
        )
        emulator.wait_for(lambda: memory() != f"{before}Mi", what="the memory request to grow")
        assert int(memory().removesuffix("Mi")) - before == 32 * 1024
        emulator.wait_for(lambda: (cr().get("status") or {}).get("kvOffload"), what="status.kvOffload")
        assert cr()["status"]["kvOffload"] == {"hostBytesPerReplica": 32 * GiB, "hostBytesPerPod": 32 * GiB}
        assert "--kv-offloading-size" in _command(emulator.get(emulator.CHILDREN["Deployment"], NS, NAME))
    assert runner.exit_code == 0 and runner.exception is None
    assert "Traceback" not in runner.output, runner.output[-3000:]

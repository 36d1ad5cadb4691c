"""spec.router.kvEvents (issue 40): active-active routers on the engines' KV events. The engine's
--kv-events-config is what the runtime parses, the router's flags are what `kvserve router` parses into
subscriptions on the same ports, the NetworkPolicy opens exactly those ports to exactly the router pods, every
object validates against the upstream schema, and a spec that would break is refused naming the field."""

from __future__ import annotations

import argparse
import pathlib

import kubernetes_validate
import pytest
import yaml

from kvserve.cli import router as router_cli
from kvserve.cli import router_kv_events
from kvserve.operator import labels, render
from kvserve.operator import spec as spec_mod
from kvserve.runtime import engine_args
from kvserve.runtime.kv_events.config import parse_kv_events_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S_VERSION = "1.33"
NAME = "llama70b"


def _doc(**router) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / "llama70b.yaml").read_text())
    doc["spec"]["router"] = router
    return doc


def _render(doc: dict) -> dict[tuple[str, str], dict]:
    resolved = spec_mod.resolve(doc["spec"])
    return {(o["kind"], o["metadata"]["name"]): o for o in render.render(resolved, NAME, "prod")}


def _container(obj: dict) -> dict:
    (container,) = obj["spec"]["template"]["spec"]["containers"]
    return container


def _engine_flags(command: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    engine_args.EngineArgs.add_cli_args(parser)
    parser.add_argument("--host")
    parser.add_argument("--port")
    parser.add_argument("--served-model-name")
    parser.add_argument("--drain-timeout")
    return parser.parse_args(command[3:])


def _router_flags(command: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    router_cli.add_arguments(parser)
    return parser.parse_args(command[2:])


def test_two_routers_subscribe_to_every_engines_events_on_the_declared_ports():
    objs = _render(_doc(enabled=True, replicas=2))
    for obj in objs.values():
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    engine, router = _container(objs[("Deployment", NAME)]), _container(objs[("Deployment", NAME + "-router")])
    # The engine: the runtime's own parser accepts the config; PUB and replay bound on every address.
    config = parse_kv_events_config(_engine_flags(engine["command"]).kv_events_config)
    assert config is not None and config.active and config.publisher == "zmq"
    assert (config.endpoint, config.replay_endpoint) == ("tcp://*:5557", "tcp://*:5558")
    ports = {p["name"]: p["containerPort"] for p in engine["ports"]}
    assert ports == {"http": 8000, "kv-events": 5557, "kv-replay": 5558}
    # The router: `kvserve router` builds subscriptions on the same two ports of every discovered replica.
    args = _router_flags(router["command"])
    subscriptions = router_kv_events.build(args)
    assert subscriptions is not None
    assert (args.kv_events_port, args.kv_events_replay_port) == (5557, 5558)
    assert args.service == NAME  # the replicas (and so the event hosts) come from the engine Service's slices
    # The NetworkPolicy: both event ports, from the router pods only; the router pods carry those labels.
    policy = objs[("NetworkPolicy", NAME)]["spec"]
    rules = [r for r in policy["ingress"] if {p["port"] for p in r["ports"]} == {5557, 5558}]
    assert len(rules) == 1 and rules[0]["from"] == [{"podSelector": {"matchLabels": labels.router_selector(NAME)}}]
    router_pod_labels = objs[("Deployment", NAME + "-router")]["spec"]["template"]["metadata"]["labels"]
    assert labels.router_selector(NAME).items() <= router_pod_labels.items()
    assert not any(5557 in {p["port"] for p in r["ports"]} for r in policy["ingress"] if r is not rules[0])
    # Active-active: a PDB keeps one router up through a drain, and the two spread over nodes.
    pdb = objs[("PodDisruptionBudget", NAME + "-router")]["spec"]
    assert pdb["maxUnavailable"] == 1 and objs[("Deployment", NAME + "-router")]["spec"]["replicas"] == 2
    (spread,) = objs[("Deployment", NAME + "-router")]["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["labelSelector"]["matchLabels"] == labels.router_selector(NAME)


@pytest.mark.parametrize(
    ("router", "on"),
    [
        ({"enabled": True}, False),  # one router: the estimate, as before
        ({"enabled": True, "replicas": 2}, True),  # two: on by default
        ({"enabled": True, "replicas": 2, "kvEvents": {"enabled": False}}, False),
        ({"enabled": True, "kvEvents": {"enabled": True}}, True),  # one router may follow the events too
        ({"enabled": False, "kvEvents": {"enabled": True}}, False),  # nothing subscribes without a router
    ],
)
def test_when_the_events_are_on(router, on):
    objs = _render(_doc(**router))
    engine = _container(objs[("Deployment", NAME)])
    assert ("--kv-events-config" in engine["command"]) is on
    assert ("kv-events" in {p["name"] for p in engine["ports"]}) is on
    if ("Deployment", NAME + "-router") in objs:
        assert ("--kv-events-port" in _container(objs[("Deployment", NAME + "-router")])["command"]) is on
    ports = {p["port"] for r in objs[("NetworkPolicy", NAME)]["spec"]["ingress"] for p in r["ports"]}
    assert (5557 in ports) is on


def test_ports_follow_the_spec():
    objs = _render(_doc(enabled=True, replicas=3, kvEvents={"port": 6001, "replayPort": 6002}))
    config = parse_kv_events_config(_engine_flags(_container(objs[("Deployment", NAME)])["command"]).kv_events_config)
    assert (config.endpoint, config.replay_endpoint) == ("tcp://*:6001", "tcp://*:6002")
    args = _router_flags(_container(objs[("Deployment", NAME + "-router")])["command"])
    assert (args.kv_events_port, args.kv_events_replay_port) == (6001, 6002)


@pytest.mark.parametrize(
    ("patch", "words"),
    [
        ({"router": {"enabled": True, "kvEvents": {"port": 6000, "replayPort": 6000}}}, "kvEvents.port and"),
        ({"router": {"enabled": True, "kvEvents": {"port": 8000}}}, "spec.router.kvEvents.port (8000)"),
        ({"router": {"enabled": True, "kvEvents": {"replayPort": 8000}}}, "spec.router.kvEvents.replayPort (8000)"),
        (
            {"router": {"enabled": True, "replicas": 2}, "engine": {"extraArgs": ["--kv-events-config={}"]}},
            "spec.engine.extraArgs carries --kv-events-config",
        ),
    ],
)
def test_a_breaking_spec_is_refused_naming_the_field(patch, words):
    doc = _doc()
    doc["spec"].update(patch)
    with pytest.raises(spec_mod.SpecError) as err:
        spec_mod.resolve(doc["spec"])
    assert err.value.reason == "InvalidKVEvents" and words in err.value.message


def test_extra_args_may_carry_the_flag_when_the_operator_renders_none():
    """An external consumer (llm-d's indexer) may want the events without kvserve's router."""
    doc = _doc()
    doc["spec"]["engine"] = {"extraArgs": ["--kv-events-config", '{"enable_kv_cache_events": true}']}
    engine = _container(_render(doc)[("Deployment", NAME)])
    assert engine["command"].count("--kv-events-config") == 1


def test_a_multi_pod_replica_publishes_from_its_leader():
    """The engine core (and with it the publisher) runs on the leader, the pod the engine Service and so the
    router's EndpointSlices select; the workers (--headless: executor ranks only) open no ports."""
    doc = yaml.safe_load((ROOT / "examples" / "llama405b-multinode.yaml").read_text())
    doc["spec"]["router"] = {"enabled": True, "replicas": 2}
    resolved = spec_mod.resolve(doc["spec"])
    name = doc["metadata"]["name"]
    objs = {(o["kind"], o["metadata"]["name"]): o for o in render.render(resolved, name, "prod")}
    (lws,) = [o for (kind, _), o in objs.items() if kind == "LeaderWorkerSet"]
    group = lws["spec"]["leaderWorkerTemplate"]
    (leader,) = group["leaderTemplate"]["spec"]["containers"]
    (worker,) = group["workerTemplate"]["spec"]["containers"]
    assert {"kv-events", "kv-replay"} <= {p["name"] for p in leader["ports"]}
    assert parse_kv_events_config(_engine_flags(leader["command"]).kv_events_config).active
    assert "ports" not in worker and "--headless" in worker["command"]
    assert objs[("Service", name)]["spec"]["selector"].items() <= group["leaderTemplate"]["metadata"]["labels"].items()
    ports = {p["port"] for r in objs[("NetworkPolicy", name)]["spec"]["ingress"] for p in r["ports"]}
    assert {5557, 5558} <= ports

"""The operator's /metrics: plan and condition gauges per InferenceService, reconcile counters, over real HTTP."""

from __future__ import annotations

import pathlib
import socket

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvserve.operator import metrics
from kvserve.operator import spec as spec_mod
from kvserve.operator import status as status_mod

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _value(samples: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"{key} not in {sorted(k for k in samples if k[0] == name)}"
    return samples[key]


def _record(name: str, namespace: str, spec: dict, ready: int = 0) -> tuple:
    resolved = spec_mod.resolve(spec)
    plan = resolved.plan
    deployment = {
        "metadata": {"generation": 1},
        "status": {"replicas": ready, "readyReplicas": ready, "updatedReplicas": ready, "observedGeneration": 1},
    }
    status = status_mod.compute_status(
        name=name,
        namespace=namespace,
        spec=resolved.spec,
        generation=1,
        plan=plan,
        plan_reason=plan.reason,
        plan_message=plan.message,
        deployment=deployment,
        previous=None,
        now="2026-01-01T00:00:00Z",
    )
    metrics.record(namespace, name, spec=resolved.spec, plan=plan, status=status)
    return plan, status


@pytest.fixture()
def served():
    metrics.INFERENCE_SERVICES.clear()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server, thread = metrics.serve(port, addr="127.0.0.1")
    try:
        yield f"http://127.0.0.1:{port}/metrics"
    finally:
        server.shutdown()
        metrics.INFERENCE_SERVICES.clear()


def test_plan_conditions_and_replicas_per_inferenceservice(served):
    spec = yaml.safe_load((ROOT / "examples" / "llama3-8b-l4.yaml").read_text())["spec"]
    spec["autoscaling"] = {"enabled": True, "minReplicas": 2, "maxReplicas": 6, "targetQueueDepth": 3}
    plan, _ = _record("llama3-8b", "ml", spec, ready=1)
    too_big = {**spec, "engine": {**spec["engine"], "maxModelLen": 1_048_576}, "autoscaling": {"enabled": False}}
    bad_plan, _ = _record("huge", "ml", too_big)
    assert plan.fits and not bad_plan.fits

    samples = _samples(httpx.get(served, timeout=10).text)
    key = {"namespace": "ml", "inferenceservice": "llama3-8b"}
    assert _value(samples, "kvserve_inferenceservice_plan_kv_tokens", **key) == plan.kv_tokens
    assert _value(samples, "kvserve_inferenceservice_plan_max_concurrency", **key) == plan.max_concurrency
    assert _value(samples, "kvserve_inferenceservice_plan_num_blocks_per_gpu", **key) == plan.num_blocks_per_gpu
    assert _value(samples, "kvserve_inferenceservice_plan_kv_cache_bytes_per_gpu", **key) == plan.kv_cache_bytes_per_gpu
    assert _value(samples, "kvserve_inferenceservice_plan_block_size_tokens", **key) == 16
    assert _value(samples, "kvserve_inferenceservice_plan_fits", **key) == 1
    # spec.replicas (2 in the example) is what the HPA writes through /scale; one pod is ready.
    assert _value(samples, "kvserve_inferenceservice_desired_replicas", **key) == 2
    assert _value(samples, "kvserve_inferenceservice_ready_replicas", **key) == 1
    assert _value(samples, "kvserve_inferenceservice_autoscaling_max_replicas", **key) == 6
    assert _value(samples, "kvserve_inferenceservice_autoscaling_target_queue_depth", **key) == 3
    # Conditions: one series per (type, status); exactly the current status is 1.
    assert _value(samples, "kvserve_inferenceservice_condition", type="CapacityPlanned", status="True", **key) == 1
    assert _value(samples, "kvserve_inferenceservice_condition", type="CapacityPlanned", status="False", **key) == 0
    assert _value(samples, "kvserve_inferenceservice_condition", type="Ready", status="False", **key) == 1
    huge = {"namespace": "ml", "inferenceservice": "huge"}
    assert _value(samples, "kvserve_inferenceservice_condition", type="CapacityPlanned", status="False", **huge) == 1
    assert _value(samples, "kvserve_inferenceservice_plan_fits", **huge) == 0
    # Autoscaling off: no HPA figures rather than made-up ones.
    assert ("kvserve_inferenceservice_autoscaling_max_replicas", tuple(sorted(huge.items()))) not in samples

    metrics.forget("ml", "huge")
    samples = _samples(httpx.get(served, timeout=10).text)
    assert not [k for k in samples if ("inferenceservice", "huge") in k[1]]
    assert _value(samples, "kvserve_inferenceservice_plan_kv_tokens", **key) == plan.kv_tokens


def test_reconcile_counters_and_durations(served):
    def count(text: str, name: str, **labels) -> float:
        return _samples(text).get((name, tuple(sorted(labels.items()))), 0.0)

    before = httpx.get(served, timeout=10).text
    with metrics.timed_reconcile("resync"):
        pass
    with pytest.raises(RuntimeError):
        with metrics.timed_reconcile("resync"):
            raise RuntimeError("API down")
    after = httpx.get(served, timeout=10).text
    for name, labels in [
        ("kvserve_operator_reconciles_total", {"trigger": "resync", "result": "success"}),
        ("kvserve_operator_reconciles_total", {"trigger": "resync", "result": "error"}),
        ("kvserve_operator_reconcile_errors_total", {"trigger": "resync", "error": "RuntimeError"}),
    ]:
        assert count(after, name, **labels) == count(before, name, **labels) + 1, (name, labels)
    assert (
        count(after, "kvserve_operator_reconcile_duration_seconds_count", trigger="resync")
        == count(before, "kvserve_operator_reconcile_duration_seconds_count", trigger="resync") + 2
    )

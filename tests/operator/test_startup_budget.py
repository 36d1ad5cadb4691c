"""The engine's startupProbe from the model's size and the runtime's start-up phases (issue 43,
operator/startup_budget.py): the formula as documented, in the runtime's phase names, the rendered probe covering
the budget, and spec.startupTimeoutSeconds replacing it."""

from __future__ import annotations

import math
import pathlib

import pytest
import yaml

from kvserve.operator import render, startup_budget
from kvserve.operator import spec as spec_mod
from kvserve.runtime import startup_phases

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _resolved(example: str = "llama3-8b-l4", **spec) -> spec_mod.Resolved:
    doc = yaml.safe_load((ROOT / "examples" / f"{example}.yaml").read_text())
    doc["spec"].pop("startupTimeoutSeconds", None)
    doc["spec"].update(spec)
    return spec_mod.resolve(doc["spec"])


def _engine_container(resolved: spec_mod.Resolved) -> tuple[dict, dict]:
    objs = render.render(resolved, "m", "prod")
    for obj in objs:
        if obj["kind"] == "Deployment" and obj["metadata"]["name"] == "m":
            return obj, obj["spec"]["template"]["spec"]["containers"][0]
        if obj["kind"] == "LeaderWorkerSet":
            return obj, obj["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    raise AssertionError("no engine workload")


def _budget(resolved: spec_mod.Resolved) -> int:
    return startup_budget.budget_seconds(resolved.spec, resolved.plan, resolved.layout.nodes)


def test_the_phases_are_the_runtimes():
    """The table speaks the runtime's phase names (kvserve:startup_phase_seconds{phase}), so a measured pod's
    phases compare one to one with the estimate."""
    resolved = _resolved(gpu={"product": "l4", "tensorParallelSize": 2}, engine={"extraArgs": ["--cuda-graphs"]})
    phases = startup_budget.expected_phase_seconds(resolved.spec, resolved.plan)
    assert set(phases) <= set(startup_phases.ORDER) - {"total"}
    assert set(startup_budget.OTHER_PHASE_SECONDS) <= set(startup_phases.ORDER)
    assert {"weight_load", "kernel_compile", "cuda_graph_capture", "distributed_init"} <= set(phases)


def test_the_documented_formula():
    resolved = _resolved()  # Llama-3-8B bf16 on one L4
    weights = resolved.plan.weight_bytes_per_gpu
    assert weights > 15e9  # 8B parameters in bf16
    other = sum(v for k, v in startup_budget.OTHER_PHASE_SECONDS.items() if k != "distributed_init")  # one rank
    expected = weights / startup_budget.WEIGHT_READ_BYTES_PER_S + startup_budget.KERNEL_COMPILE_SECONDS + other
    budget = math.ceil(startup_budget.SAFETY_FACTOR * expected)
    assert _budget(resolved) == budget
    deployment, container = _engine_container(resolved)
    probe = container["startupProbe"]
    assert probe["periodSeconds"] == startup_budget.PERIOD_SECONDS
    assert probe["failureThreshold"] * probe["periodSeconds"] >= budget > (probe["failureThreshold"] - 1) * 10
    assert deployment["spec"]["progressDeadlineSeconds"] == budget + startup_budget.PROGRESS_MARGIN_SECONDS


def test_the_budget_grows_with_the_weights_and_the_phases_that_run():
    small, large = _budget(_resolved()), _budget(_resolved("llama70b"))
    assert large > 3 * small  # 70B over 4 GPUs in one pod: every byte still comes off the pod's volume
    torch_backend = _resolved(engine={"extraArgs": ["--attention-backend=torch"]})  # nothing to compile
    graphs = _resolved(engine={"extraArgs": ["--cuda-graphs"]})
    factor = startup_budget.SAFETY_FACTOR
    assert small - _budget(torch_backend) == factor * startup_budget.KERNEL_COMPILE_SECONDS
    assert _budget(graphs) - small == factor * startup_budget.CUDA_GRAPH_CAPTURE_SECONDS


def test_a_multi_pod_replica_budgets_each_pods_own_stage():
    resolved = _resolved("llama405b-multinode")
    assert resolved.layout.multinode
    phases = startup_budget.expected_phase_seconds(resolved.spec, resolved.plan, resolved.layout.nodes)
    per_pod = resolved.plan.weight_bytes_per_gpu * resolved.spec.gpu.tensor_parallel_size
    assert phases["weight_load"] == per_pod / startup_budget.WEIGHT_READ_BYTES_PER_S
    assert per_pod < resolved.model.num_parameters * 2 * 0.6  # about half of the bf16 weights: one stage of two
    _, container = _engine_container(resolved)
    assert container["startupProbe"]["failureThreshold"] == startup_budget.failure_threshold(_budget(resolved))


def test_a_tiny_model_gets_the_floor():
    shape = {
        "numLayers": 2,
        "numAttentionHeads": 8,
        "numKeyValueHeads": 2,
        "headDim": 64,
        "hiddenSize": 512,
        "numParameters": 50_000_000,
        "maxPositionEmbeddings": 8192,
        "intermediateSize": 1024,
        "vocabSize": 32000,
    }
    tiny = {"model": {"uri": "pvc://models/tiny", "shape": shape}}
    assert _budget(_resolved(**tiny)) > startup_budget.MIN_BUDGET_SECONDS  # the kernel compile alone is 2 x 120 s
    resolved = _resolved(**tiny, engine={"extraArgs": ["--attention-backend", "torch"]})
    assert _budget(resolved) == startup_budget.MIN_BUDGET_SECONDS


@pytest.mark.parametrize("seconds", [60, 5400])
def test_spec_startup_timeout_seconds_replaces_the_budget(seconds):
    resolved = _resolved(startupTimeoutSeconds=seconds)
    assert _budget(resolved) == seconds
    deployment, container = _engine_container(resolved)
    assert container["startupProbe"]["failureThreshold"] == math.ceil(seconds / startup_budget.PERIOD_SECONDS)
    assert deployment["spec"]["progressDeadlineSeconds"] == seconds + startup_budget.PROGRESS_MARGIN_SECONDS

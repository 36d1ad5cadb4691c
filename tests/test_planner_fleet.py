"""The SLO search (runtime/planner/slo.py, fleet.py) and its catalog glue (operator/fleet.py)."""

import dataclasses
import math

import pytest

from kvserve.operator import catalog, planner
from kvserve.operator import fleet as fleet_mod
from kvserve.runtime.planner.fleet import Candidate, search
from kvserve.runtime.planner.simulator import EngineShape, LengthSpec, Workload, simulate
from kvserve.runtime.planner.slo import SLO, Capacity, hpa_bounds, replica_capacity
from kvserve.runtime.planner.step_time import StepTimeModel

STEP = StepTimeModel(overhead_s=0.01, per_token_s=1e-4, per_context_token_s=0.0)
SHAPE = EngineShape(num_blocks=2000, block_size=16, max_num_seqs=16, max_num_batched_tokens=512, max_model_len=512)
WORK = Workload(LengthSpec(64, 64), LengthSpec(16, 16), num_requests=120, request_rate=1.0, seed=3)


def test_capacity_is_the_edge_of_the_slo():
    # One request alone: TTFT 16.4 ms (10 ms + 64 x 0.1 ms), TPOT 10.1 ms; 30 ms p90 leaves room for queueing.
    slo = SLO(ttft_p90_s=0.03, tpot_p99_s=0.05)
    cap = replica_capacity(WORK, SHAPE, STEP, slo)
    assert cap.feasible and slo.met_by(cap.at_capacity)
    # A little more load breaks the SLO; the capacity sits below saturation.
    over = simulate(dataclasses.replace(WORK, request_rate=cap.requests_per_s * 1.15), SHAPE, STEP)
    assert not slo.met_by(over)
    saturated = simulate(dataclasses.replace(WORK, request_rate=None, concurrency=16), SHAPE, STEP)
    assert cap.requests_per_s < saturated.requests_per_s
    # A looser TTFT admits more load; a TPOT near one request's own binds instead.
    assert replica_capacity(WORK, SHAPE, STEP, SLO(0.05, 0.05)).requests_per_s > 2 * cap.requests_per_s
    tpot_bound = replica_capacity(WORK, SHAPE, STEP, SLO(1.0, 0.013))
    assert tpot_bound.feasible and tpot_bound.at_capacity.tpot_s["p99"] <= 0.013
    assert tpot_bound.requests_per_s < replica_capacity(WORK, SHAPE, STEP, SLO(1.0, 0.05)).requests_per_s


def test_unreachable_slo_names_the_metric():
    # One step alone costs 10 ms + 6.4 ms of prefill: a 5 ms TTFT can never hold.
    cap = replica_capacity(WORK, SHAPE, STEP, SLO(0.005, 1.0))
    assert not cap.feasible and "TTFT p90" in cap.reason and "TPOT" not in cap.reason
    with pytest.raises(ValueError, match="no replica count meets the SLO: even one request"):
        hpa_bounds(cap, 10.0)
    with pytest.raises(ValueError, match="ttft_p90_s must be > 0"):
        SLO(0, 1)


def test_hpa_bounds_from_capacity():
    base = simulate(dataclasses.replace(WORK, request_rate=2.0), SHAPE, STEP)
    cap = Capacity(2.5, dataclasses.replace(base, mean_queue_depth=2.2))
    h = hpa_bounds(cap, peak_requests_per_s=11.0, min_requests_per_s=3.0)
    assert (h.min_replicas, h.max_replicas, h.target_queue_depth) == (2, 5, 3)  # ceil(3/2.5), ceil(11/2.5), ceil(2.2)
    assert hpa_bounds(Capacity(2.5, base), 2.0).min_replicas == 1  # never below one replica
    with pytest.raises(ValueError, match="min_request_rate"):
        hpa_bounds(cap, 2.0, 3.0)


def test_queue_depth_grows_with_load():
    light = simulate(dataclasses.replace(WORK, request_rate=1.0), SHAPE, STEP)
    heavy = simulate(dataclasses.replace(WORK, request_rate=None, concurrency=64), SHAPE, STEP)
    assert light.mean_queue_depth < 0.1 and heavy.mean_queue_depth > 25  # 64 clients, 16 slots: 48 wait until the tail


def test_search_picks_the_cheapest_feasible():
    slow = dataclasses.replace(STEP, overhead_s=0.03)
    cands = [
        Candidate("fast-dear", 1, 10.0, SHAPE, STEP, "test"),
        Candidate("slow-cheap", 1, 1.0, SHAPE, slow, "test"),
        Candidate("hopeless", 1, 0.1, SHAPE, dataclasses.replace(STEP, overhead_s=1.0), "test"),
    ]
    slo = SLO(0.5, 0.06)
    opts = search(cands, WORK, slo, peak_requests_per_s=100.0)
    by = {o.candidate.gpu: o for o in opts}
    assert (
        by["hopeless"].hpa is None and math.isinf(by["hopeless"].usd_per_hour) and opts[-1].candidate.gpu == "hopeless"
    )
    for o in opts[:2]:
        assert o.replicas == math.ceil(100.0 / o.replica_requests_per_s)
        assert o.usd_per_hour == pytest.approx(o.replicas * o.candidate.usd_per_gpu_hour)
    assert opts[0].usd_per_hour <= opts[1].usd_per_hour
    # The slow GPU needs more replicas but is 10x cheaper per hour here, so it wins.
    assert by["slow-cheap"].replicas > by["fast-dear"].replicas and opts[0].candidate.gpu == "slow-cheap"


def test_roofline_candidates_from_the_catalog():
    base = planner.PlanInput(model=catalog.lookup_model("llama-3-70b"), gpu_memory_bytes=1)
    cands = fleet_mod.candidates(base, ["l4", "h100-80gb"], gpus_per_node=8)
    # 70B bf16 (141 GB) fits no single 80 GB GPU; H100 TP 2 (70.6 GB/GPU) and up fit, 24 GB L4s only at TP 8.
    assert {(c.gpu, c.tensor_parallel_size) for c in cands} == {
        ("h100-80gb", 2),
        ("h100-80gb", 4),
        ("h100-80gb", 8),
        ("l4", 8),
    }
    h100_4 = next(c for c in cands if c.gpu == "h100-80gb" and c.tensor_parallel_size == 4)
    h100_8 = next(c for c in cands if c.gpu == "h100-80gb" and c.tensor_parallel_size == 8)
    # Roofline: twice the GPUs, half the weight reads and FLOPs per rank.
    assert h100_8.step_model.per_token_s == pytest.approx(h100_4.step_model.per_token_s / 2)
    assert "roofline" in h100_4.step_time_source and "not measured" in h100_4.step_time_source
    calibrated = StepTimeModel(0.02, 1e-5, 1e-8)
    cands = fleet_mod.candidates(
        base, ["h100-80gb"], 8, prices={"h100-80gb": 2.0}, calibrated=("h100-80gb", 4, calibrated, "dev")
    )
    c4 = next(c for c in cands if c.tensor_parallel_size == 4)
    assert c4.step_model == calibrated and c4.step_time_source == "calibration (dev)" and c4.usd_per_gpu_hour == 2.0


def test_target_from_spec_names_fields():
    assert fleet_mod.target_from_spec({}) is None
    t = fleet_mod.target_from_spec(
        {
            "slo": {"ttftP90Seconds": 2, "tpotP99Seconds": 0.1},
            "workload": {"requestRate": 40, "minRequestRate": 4, "promptLen": "100:200", "outputLen": 64},
        }
    )
    assert t.request_rate == 40 and t.min_request_rate == 4 and t.workload.prompt_len == LengthSpec(100, 200)
    with pytest.raises(ValueError, match="spec.workload is required with spec.slo"):
        fleet_mod.target_from_spec({"slo": {"ttftP90Seconds": 2, "tpotP99Seconds": 0.1}})
    with pytest.raises(ValueError, match="spec.workload.requestRate must be a number"):
        fleet_mod.target_from_spec({"slo": {"ttftP90Seconds": 2, "tpotP99Seconds": 0.1}, "workload": {}})
    with pytest.raises(ValueError, match="spec.workload.minRequestRate"):
        fleet_mod.target_from_spec(
            {"slo": {"ttftP90Seconds": 2, "tpotP99Seconds": 0.1}, "workload": {"requestRate": 1, "minRequestRate": 2}}
        )
    with pytest.raises(ValueError, match="spec.workload.promptLen"):
        fleet_mod.target_from_spec(
            {"slo": {"ttftP90Seconds": 2, "tpotP99Seconds": 0.1}, "workload": {"requestRate": 1, "promptLen": "x"}}
        )

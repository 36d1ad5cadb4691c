"""PlanDrift's pure comparison (operator/plan_drift.py): a pod's /metrics window against the planner's prediction
for that load, and the condition's hysteresis. The pod side is the engine's real exposition (ServerMetrics)."""

from __future__ import annotations

import dataclasses

import pytest

from kvserve.operator import drift, plan_drift, transitions
from kvserve.operator import spec as spec_mod
from kvserve.operator import status as status_mod
from kvserve.operator.plan_drift import Counters, DriftSettings, Measured, PodDrift
from kvserve.runtime.metrics import ServerMetrics
from kvserve.runtime.planner.simulator import LengthSpec
from kvserve.runtime.planner.slo import at_rate

SPEC = {
    "model": {"uri": "pvc://models/llama-3-8b", "name": "llama-3-8b"},
    "gpu": {"product": "h100-80gb"},
    "slo": {"ttftP90Seconds": 1.0, "tpotP99Seconds": 0.05},
    "workload": {"requestRate": 100, "promptLen": 512, "outputLen": 64},
}


@pytest.fixture(scope="module")
def planned():
    resolved = spec_mod.resolve(SPEC)
    return drift.planned(resolved.fleet, SPEC)


def _serve(m: ServerMetrics, n: int, ttft_s: float, tpot_s: float, prompt: int = 512, output: int = 64) -> None:
    """n finished requests as the async engine records them."""
    for _ in range(n):
        m.time_to_first_token.observe(ttft_s)
        m.observe_finished(
            finish_reason="length",
            num_prompt_tokens=prompt,
            num_generation_tokens=output,
            arrival_time=0.0,
            first_scheduled_time=0.0,
            first_token_time=ttft_s,
            finished_time=ttft_s + tpot_s * (output - 1),
        )


def _text(m: ServerMetrics) -> str:
    return m.render().decode()


def test_a_window_of_the_engines_own_metrics_is_the_means_and_the_rate():
    m = ServerMetrics("m", 4096)
    _serve(m, 3, 0.5, 0.1)
    start = plan_drift.parse_counters(_text(m), 100.0)
    _serve(m, 10, 0.02, 0.01, prompt=100, output=11)
    end = plan_drift.parse_counters(_text(m), 105.0)
    w = plan_drift.window(start, end)
    assert w.requests == 10 and w.requests_per_s == pytest.approx(2.0)
    assert w.ttft_mean_s == pytest.approx(0.02) and w.tpot_mean_s == pytest.approx(0.01)
    assert (w.mean_prompt_tokens, w.mean_output_tokens) == (pytest.approx(100), pytest.approx(11))


def test_a_counter_going_back_is_a_restart_not_a_window():
    m = ServerMetrics("m", 4096)
    _serve(m, 5, 0.1, 0.01)
    later = plan_drift.parse_counters(_text(m), 10.0)
    restarted = plan_drift.parse_counters(_text(ServerMetrics("m", 4096)), 20.0)
    assert plan_drift.window(later, restarted) is None
    assert plan_drift.window(later, dataclasses.replace(later)) is None  # no time passed


def test_text_that_is_not_prometheus_is_an_error():
    with pytest.raises(ValueError):
        plan_drift.parse_counters("<html>nope</html>", 0.0)


def test_the_prediction_is_the_planners_simulation_at_the_measured_load(planned):
    candidate, workload = planned
    measured = Measured(10.0, 100, 10.0, 512.0, 64.0, 0.03, 0.013)
    p = plan_drift.predict(candidate, workload, measured)
    w = dataclasses.replace(workload, prompt_len=LengthSpec(510, 510), output_len=LengthSpec(64, 64))
    sim = at_rate(w, candidate.shape, candidate.step_model, 10.0)  # two significant digits: 512 -> 510
    assert (p.ttft_p50_s, p.tpot_p50_s) == (sim.ttft_s["p50"], sim.tpot_s["p50"])
    assert (p.requests_per_s, p.prompt_tokens, p.output_tokens) == (10.0, 510, 64)
    # More load, longer steps: the prediction follows the pod's load, not the plan's capacity.
    busier = plan_drift.predict(candidate, workload, dataclasses.replace(measured, requests_per_s=35.0))
    assert busier.tpot_p50_s > p.tpot_p50_s * 1.5


def _judged(planned, factor: float, requests: int = 100, rate: float = 10.0) -> plan_drift.Judgement | None:
    candidate, workload = planned
    probe = Measured(requests / rate, requests, rate, 512.0, 64.0, None, None)
    p = plan_drift.predict(candidate, workload, probe)
    m = dataclasses.replace(probe, ttft_mean_s=p.ttft_p50_s * factor, tpot_mean_s=p.tpot_p50_s * factor)
    return plan_drift.judge(m, p, DriftSettings())


def test_judge_names_measured_vs_planned_and_by_how_much(planned):
    on_plan, slow, fast = _judged(planned, 1.1), _judged(planned, 2.0), _judged(planned, 0.6)
    assert not on_plan.beyond
    assert slow.beyond and slow.slower
    assert "+100%" in slow.text() and "TPOT mean" in slow.text() and "planned" in slow.text()
    assert fast.beyond and not fast.slower and "-40%" in fast.text()
    assert _judged(planned, 3.0, requests=DriftSettings().min_requests - 1) is None  # too few requests: no verdict


def test_ttft_has_its_own_wider_tolerance(planned):
    candidate, workload = planned
    probe = Measured(10.0, 100, 10.0, 512.0, 64.0, None, None)
    p = plan_drift.predict(candidate, workload, probe)
    m = dataclasses.replace(probe, ttft_mean_s=p.ttft_p50_s * 1.4, tpot_mean_s=p.tpot_p50_s)
    assert not plan_drift.judge(m, p, DriftSettings()).beyond  # +40% TTFT: within 50%
    assert plan_drift.judge(m, p, DriftSettings(ttft_tolerance=0.3)).beyond


def test_the_condition_flips_after_n_disagreeing_windows_both_ways(planned):
    settings = DriftSettings(resyncs=3)
    slow, ok = _judged(planned, 2.0), _judged(planned, 1.0)
    state = PodDrift()
    for _ in range(2):
        state = plan_drift.advance(state, slow, settings)
        assert not state.drifted
    state = plan_drift.advance(state, ok, settings)  # one good window resets the count
    assert state.disagreeing == 0
    for _ in range(3):
        state = plan_drift.advance(state, slow, settings)
    assert state.drifted
    status, reason, message = plan_drift.condition({"pod-b": state, "pod-a": PodDrift()}, settings)
    assert (status, reason) == (True, "SlowerThanPlanned")
    assert message.startswith("1/2 ready pods beyond tolerance for 3 resyncs: pod pod-b: TPOT mean")
    for _ in range(2):
        state = plan_drift.advance(state, ok, settings)
    assert state.drifted  # still drifted, and the message keeps naming the slow window
    assert "+100%" in plan_drift.condition({"pod-b": state}, settings)[2]
    state = plan_drift.advance(state, ok, settings)
    assert not state.drifted
    assert plan_drift.condition({"pod-b": state}, settings)[:2] == (False, "WithinTolerance")


def test_nothing_judged_is_not_measured():
    assert plan_drift.condition({}, DriftSettings(), "no ready engine pod to measure") == (
        False,
        "NotMeasured",
        "no ready engine pod to measure",
    )


@pytest.mark.parametrize(
    "field,value", [("tpot_tolerance", 0), ("ttft_tolerance", -1.0), ("resyncs", 0), ("min_requests", 1.5)]
)
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        DriftSettings(**{field: value})


def test_settings_come_from_the_environment_naming_the_variable():
    s = drift.settings_from_env({"KVSERVE_DRIFT_RESYNCS": "5", "KVSERVE_DRIFT_TPOT_TOLERANCE": "0.1"})
    assert (s.resyncs, s.tpot_tolerance, s.ttft_tolerance) == (5, 0.1, DriftSettings().ttft_tolerance)
    with pytest.raises(ValueError, match="KVSERVE_DRIFT_RESYNCS"):
        drift.settings_from_env({"KVSERVE_DRIFT_RESYNCS": "three"})
    with pytest.raises(ValueError, match="KVSERVE_DRIFT_MIN_REQUESTS=0"):
        drift.settings_from_env({"KVSERVE_DRIFT_MIN_REQUESTS": "0"})


def test_status_carries_plan_drift_and_an_event_marks_its_rise():
    spec = spec_mod.resolve(SPEC).spec
    common = dict(
        name="chat",
        namespace="ns",
        spec=spec,
        generation=1,
        plan=None,
        plan_reason="",
        plan_message="",
        deployment=None,
        now="2026-12-05T00:00:00Z",
    )
    calm = status_mod.compute_status(previous=None, plan_drift=(False, "WithinTolerance", "ok"), **common)
    drifted = status_mod.compute_status(previous=calm, plan_drift=(True, "SlowerThanPlanned", "pod x: slow"), **common)
    cond = next(c for c in drifted["conditions"] if c["type"] == "PlanDrift")
    assert (cond["status"], cond["reason"]) == ("True", "SlowerThanPlanned")
    assert transitions.warnings(calm, drifted) == [("SlowerThanPlanned", "pod x: slow")]
    assert transitions.warnings(drifted, drifted) == []  # one Event per rise, not one per resync
    assert all(c["type"] != "PlanDrift" for c in status_mod.compute_status(previous=None, **common)["conditions"])


def test_observe_scrapes_only_ready_engine_leaders():
    def pod(name, component="engine", ready=True, ip="10.0.0.1", worker=None, deleting=False):
        meta = {"name": name, "labels": {"app.kubernetes.io/component": component}}
        if worker is not None:
            meta["labels"][drift.WORKER_INDEX_LABEL] = worker
        if deleting:
            meta["deletionTimestamp"] = "2026-12-05T00:00:00Z"
        return {
            "metadata": meta,
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
        }

    pods = [
        pod("a"),
        pod("router", component="router"),
        pod("b", ready=False),
        pod("leader", worker="0", ip="10.0.0.2"),
        pod("worker", worker="1"),
        pod("c", deleting=True),
        pod("d", ip=None),
    ]
    assert drift._engine_pods(pods, 8000) == {
        "a": "http://10.0.0.1:8000/metrics",
        "leader": "http://10.0.0.2:8000/metrics",
    }


def test_counters_of_a_pod_without_the_histograms_are_zero():
    c = plan_drift.parse_counters("# nothing here\n", 1.0)
    assert isinstance(c, Counters) and set(c.counts.values()) == {0.0}


def test_an_unreachable_pod_is_not_measured_says_why_and_is_scraped_ever_more_rarely(planned, monkeypatch):
    import socket

    with socket.socket() as s:  # a port nothing listens on: connection refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pod = {
        "metadata": {"name": "p", "labels": {"app.kubernetes.io/component": "engine"}},
        "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    monkeypatch.setattr(drift, "_objects", {})
    messages = []
    for _ in range(4):
        drift.observe("ns", "x", planned, [pod], port)
        messages.append(drift.current("ns", "x", planned, None))
    assert all(m[:2] == (False, "NotMeasured") for m in messages)
    assert "cannot read http://127.0.0.1" in messages[0][2] and "spec.networkPolicy.from" in messages[0][2]
    assert "cannot read" in messages[1][2]  # the second failure in a row: skip the next resync
    assert "not scraped for 1 more resyncs after 2 failed scrapes" in messages[2][2]
    assert "cannot read" in messages[3][2]
    assert [drift._skip_after(n) for n in range(1, 7)] == [0, 1, 3, 7, 15, 15]


def test_a_restarted_operator_keeps_the_written_condition_until_it_measures(planned, monkeypatch):
    monkeypatch.setattr(drift, "_objects", {})
    written = {"type": "PlanDrift", "status": "True", "reason": "SlowerThanPlanned", "message": "pod p: slow"}
    assert drift.current("ns", "x", planned, written) == (True, "SlowerThanPlanned", "pod p: slow")
    assert drift.current("ns", "x", None, written) is None  # spec.slo removed: no condition
    drift.observe("ns", "x", planned, [], 8000)  # measuring, nothing judged yet: the written condition stands
    assert drift.current("ns", "x", planned, written) == (True, "SlowerThanPlanned", "pod p: slow")
    other_plan = (planned[0], dataclasses.replace(planned[1], seed=planned[1].seed + 1))
    drift.observe("ns", "x", other_plan, [], 8000)  # a new plan: the old verdict is not about it
    assert drift.current("ns", "x", other_plan, written) == (False, "NotMeasured", "no ready engine pod to measure")


def _ready_pod(name: str) -> dict:
    return {
        "metadata": {"name": name, "labels": {"app.kubernetes.io/component": "engine"}},
        "status": {"podIP": "10.0.0.9", "conditions": [{"type": "Ready", "status": "True"}]},
    }


def test_observe_judges_a_window_once_it_holds_enough_requests(planned, monkeypatch):
    m = ServerMetrics("m", 8192)
    monkeypatch.setattr(drift, "_objects", {})
    monkeypatch.setattr(drift, "_scrape", lambda url, timeout_s: (_text(m), ""))
    monkeypatch.setattr(drift, "SETTINGS", DriftSettings(resyncs=1, min_requests=20))
    drift.observe("ns", "x", planned, [_ready_pod("p")], 8000)  # the baseline
    _serve(m, 10, 1.0, 1.0)
    drift.observe("ns", "x", planned, [_ready_pod("p")], 8000)
    assert drift.current("ns", "x", planned, None)[1] == "NotMeasured"  # 10 < 20 requests: the window grows
    _serve(m, 10, 1.0, 1.0)  # a second per output token: far slower than an H100 plan
    drift.observe("ns", "x", planned, [_ready_pod("p")], 8000)
    status, reason, message = drift.current("ns", "x", planned, None)
    assert (status, reason) == (True, "SlowerThanPlanned") and "(20 requests over" in message


def test_a_load_the_planner_cannot_simulate_is_said_not_raised(planned, monkeypatch):
    m = ServerMetrics("m", 8192)

    def refuse(*_):
        raise RuntimeError("simulation stalled: a request cannot be scheduled (KV pool too small?)")

    monkeypatch.setattr(drift, "_objects", {})
    monkeypatch.setattr(drift, "_scrape", lambda url, timeout_s: (_text(m), ""))
    monkeypatch.setattr(drift, "predict", refuse)
    drift.observe("ns", "x", planned, [_ready_pod("p")], 8000)
    _serve(m, 30, 0.1, 0.01)
    drift.observe("ns", "x", planned, [_ready_pod("p")], 8000)
    status, reason, message = drift.current("ns", "x", planned, None)
    assert (status, reason) == (
        False,
        "NotMeasured",
    ) and "pod p: no prediction for its load (simulation stalled" in message


def test_an_idle_spell_restarts_the_window_and_the_simulation_budget_defers_judging(planned, monkeypatch):
    m = ServerMetrics("m", 8192)
    calls = []
    monkeypatch.setattr(drift, "_objects", {})
    monkeypatch.setattr(drift, "_scrape", lambda url, timeout_s: (_text(m), ""))
    monkeypatch.setattr(drift, "predict", lambda *a: calls.append(a) or plan_drift.predict(*a))
    drift.observe("ns", "x", planned, [_ready_pod("p")], 8000)
    first = drift._objects[("ns", "x")].pods["p"].baseline.time_s
    drift.observe("ns", "x", planned, [_ready_pod("p")], 8000)  # no request finished: idle
    assert drift._objects[("ns", "x")].pods["p"].baseline.time_s > first
    _serve(m, 5, 0.1, 0.01)
    drift.observe("ns", "x", planned, [_ready_pod("p")], 8000)  # 5 < 20 requests: it grows, no simulation
    assert calls == []
    monkeypatch.setattr(drift, "PREDICTION_BUDGET_S", -1.0)  # spent: judged later
    _serve(m, 30, 0.1, 0.01)
    drift.observe("ns", "x", planned, [_ready_pod("p")], 8000)
    assert calls == [] and drift.current("ns", "x", planned, None)[1] == "NotMeasured"
    monkeypatch.setattr(drift, "PREDICTION_BUDGET_S", 1.0)
    drift.observe("ns", "x", planned, [_ready_pod("p")], 8000)
    assert len(calls) == 1 and calls[0][2].requests == 35  # the grown window, from the idle scrape on

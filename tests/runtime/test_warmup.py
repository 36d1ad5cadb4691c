"""The warm-up before readiness (runtime/executor/warmup.py, issue 43): every shape class runs, the phase is
timed, the budget and KVSERVE_WARMUP=0 bound it, and the answers afterwards are token-identical to an engine that
did not warm up (same seed, sampled requests too: the warm-up draws no random numbers)."""

from __future__ import annotations

import pytest

from kvserve.runtime.demo_model import ensure_demo_model
from kvserve.runtime.engine.llm import LLM
from kvserve.runtime.executor import warmup
from kvserve.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["The harbour town woke slowly.", "Numbers have their own rhythm: one, two,", "def add(a, b):"]


def answers(llm: LLM) -> list[list[int]]:
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    sampled = SamplingParams(temperature=0.8, max_tokens=12)  # the engine's default generator, not seeded per request
    outs = llm.generate(PROMPTS, [greedy, greedy, sampled], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def make(model_dir) -> LLM:
    return LLM(str(model_dir), max_model_len=256, kv_cache_bytes=16 << 20, seed=7)


def test_warm_up_runs_every_shape_and_answers_stay_identical(tmp_path, monkeypatch, caplog):
    model_dir = ensure_demo_model(tmp_path)
    monkeypatch.setenv("KVSERVE_WARMUP", "0")
    cold = make(model_dir)
    assert "warmup" in cold.engine.startup_phases  # timed (zero work) even when off
    expected = answers(cold)
    monkeypatch.delenv("KVSERVE_WARMUP")
    with caplog.at_level("INFO", logger="kvserve.warmup"):
        warm = make(model_dir)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up: "))
    assert "prefill 32 tokens" in line and "decode 1 sequence" in line and "decode 8 sequences" in line, line
    assert warm.engine.startup_phases["warmup"] > 0
    assert not warm.engine.core.executor.runner.states  # the runner forgot the warm-up requests
    assert answers(warm) == expected


def test_budget_stops_after_the_first_shape_and_zero_switches_off(tmp_path, monkeypatch):
    llm = make(ensure_demo_model(tmp_path))
    executor, config = llm.engine.core.executor, llm.engine.core.config
    assert warmup.warm_up(executor, config, budget=1e-9) == ["prefill 32 tokens"]
    monkeypatch.setenv("KVSERVE_WARMUP", "0")
    assert warmup.warm_up(executor, config) == []
    monkeypatch.setenv("KVSERVE_WARMUP", "1")
    monkeypatch.setenv("KVSERVE_WARMUP_BUDGET_S", "soon")
    with pytest.raises(ValueError, match="KVSERVE_WARMUP_BUDGET_S"):
        warmup.warm_up(executor, config)
    assert not executor.runner.states

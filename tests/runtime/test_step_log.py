"""KVSERVE_STEP_LOG (runtime/engine/step_log.py): the engine core writes one line per step with what the step
computed, counted like the planner counts it, and the calibration fit reads it back."""

from __future__ import annotations

from kvserve.runtime.engine import step_log
from kvserve.runtime.planner.step_time import StepWork


def test_the_engine_core_logs_every_step_and_the_fit_reads_it(model_factory, tmp_path, monkeypatch):
    from kvserve.runtime.engine.llm_engine import LLMEngine
    from kvserve.runtime.sampling_params import SamplingParams

    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(step_log.ENV, str(path))
    engine = LLMEngine.from_kwargs(model_factory("llama_gqa")[0], max_model_len=128, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": list(range(3, 43))}, params)  # 40 tokens: one prefill step
    engine.add_request("b", {"prompt_token_ids": list(range(100, 180))}, params)  # 80: chunked by the 64 budget
    while engine.has_unfinished_requests():
        engine.step()
    engine.shutdown()
    samples = step_log.read(str(path))
    # Step 1: a's 40 tokens + b's first 24 (budget 64; b does not sample yet). Then b's last 56 with a's decode.
    assert samples[0].work == StepWork(64, 40 + 24, 1, 40 * 41 // 2 + 24 * 25 // 2)
    assert samples[1].work == StepWork(57, 41 + 80, 2, 41 + 56 * 24 + 56 * 57 // 2)
    assert sum(s.num_sampled for s in samples) == 6 and all(s.seconds > 0 for s in samples)
    with open(path, "a") as f:
        f.write('{"num_tokens": 1, "cut')  # a line the engine was writing when the reader came: skipped
    assert len(step_log.read(str(path))) == len(samples)


def test_off_unless_the_variable_is_set(monkeypatch):
    monkeypatch.delenv(step_log.ENV, raising=False)
    assert step_log.StepLog.from_env() is None

"""EngineCore._step_pipelined in one process: the engine core's micro-batch loop over a stand-in for the pipeline
executor (a batch runs on the real in-process model runner when it is collected, in launch order), so the
queue logic and its failure semantics are checked without worker processes (tests/parallel covers gloo)."""

from __future__ import annotations

import time
from collections import deque

import pytest
from kvserve_testing import random_prompts

from kvserve.runtime import LLM, SamplingParams
from kvserve.runtime.core.scheduler import Scheduler
from kvserve.runtime.engine.batch_queue import batches_in_flight
from kvserve.runtime.errors import InvalidParameter, WorkerDiedError


class DeferredExecutor:
    """MultiprocExecutor's submit / collect / is_done contract, in-process (the steps run at collect)."""

    def __init__(self, executor, fail_collect: int | None = None, die_collect: int | None = None):
        self.executor, self.fail_collect, self.die_collect = executor, fail_collect, die_collect
        self.pending: deque = deque()
        self.num_submitted = self.num_collected = 0

    def submit(self, sched) -> int:
        self.num_submitted += 1
        self.pending.append((self.num_submitted, sched))
        return self.num_submitted

    def collect(self, handle: int):
        oldest, sched = self.pending.popleft()
        assert oldest == handle, "collected out of launch order"
        out = self.executor.execute(sched)
        self.num_collected += 1
        if self.num_collected == self.fail_collect:
            raise RuntimeError("injected step failure")
        if self.num_collected == self.die_collect:
            raise WorkerDiedError("injected: pipeline-parallel worker rank 1 died", 1)
        return out

    def is_done(self, handle: int) -> bool:
        return False

    def shutdown(self) -> None:
        self.executor.shutdown()


def _pipelined(core, **executor_kw) -> DeferredExecutor:
    """Turn a fresh one-process core into a 2-batch micro-batching one."""
    core.scheduler = Scheduler(core.config.scheduler, core.kv_cache_manager, micro_batches=2)
    core.batch_slots = 2
    core.executor = DeferredExecutor(core.executor, **executor_kw)
    return core.executor


def _run(core, prompts, params, prefix: str, max_steps: int = 2000):
    tokens, failures = {}, {}
    for i, p in enumerate(prompts):
        core.add_request(f"{prefix}{i}", p, params, time.monotonic())
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            break
        step = core.step()
        for d in step.deltas:
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
        failures.update({f.request_id: f for f in step.failures})
    assert not core.has_unfinished_requests()
    return {rid.removeprefix(prefix): t for rid, t in tokens.items()}, {
        rid.removeprefix(prefix): f for rid, f in failures.items()
    }


KW = dict(max_model_len=128, max_num_batched_tokens=48, max_num_seqs=8, num_kv_blocks=64)


@pytest.fixture(scope="module")
def workload(model_factory):
    """The model, the requests, and their tokens from the plain (one batch at a time) steps."""
    model_dir, hf_model = model_factory("llama_gqa")
    prompts = random_prompts(6, hf_model.config.vocab_size, 4, 70, seed=2)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(model_dir, **KW) as llm:
        reference, _ = _run(llm.engine.core, prompts, params, "ref-")
    return model_dir, prompts, params, reference


@pytest.fixture
def setup(workload):
    model_dir, prompts, params, reference = workload
    llm = LLM(model_dir, **KW)
    yield llm.engine.core, prompts, params, reference
    llm.shutdown()


def test_two_batches_in_flight_give_the_plain_steps_tokens(setup):
    core, prompts, params, reference = setup
    runner = _pipelined(core)
    tokens, failures = _run(core, prompts, params, "mb-")
    assert tokens == reference and not failures
    assert core.max_batches_in_flight == 2
    assert runner.num_submitted == runner.num_collected and core.scheduler.num_in_flight == 0


def test_a_failed_batch_fails_its_requests_only(setup):
    core, prompts, params, reference = setup
    _pipelined(core, fail_collect=3)
    tokens, failures = _run(core, prompts, params, "f-")
    assert failures and all(f.retryable for f in failures.values())
    assert core.num_step_failures == 1 and core.dead_error is None
    survivors = set(reference) - set(failures)
    assert survivors and {rid: tokens[rid] for rid in survivors} == {rid: reference[rid] for rid in survivors}
    assert core.scheduler.num_in_flight == 0


def test_a_dead_worker_kills_the_core(setup):
    core, prompts, params, _ = setup
    _pipelined(core, die_collect=2)
    with pytest.raises(WorkerDiedError, match="rank 1 died"):
        _run(core, prompts, params, "d-")
    with pytest.raises(WorkerDiedError):
        core.step()
    with pytest.raises(WorkerDiedError):
        core.check_health()


def test_batches_in_flight_setting(monkeypatch):
    assert batches_in_flight(1) == 1
    assert batches_in_flight(4) == 4  # vLLM's max_concurrent_batches: the stage count
    monkeypatch.setenv("KVSERVE_PP_BATCHES_IN_FLIGHT", "1")
    assert batches_in_flight(2) == 1
    monkeypatch.setenv("KVSERVE_PP_BATCHES_IN_FLIGHT", "two")
    with pytest.raises(InvalidParameter, match="KVSERVE_PP_BATCHES_IN_FLIGHT must be an integer >= 1"):
        batches_in_flight(2)

"""The engine-core messages survive the wire exactly (runtime/engine/core_messages.py), and the core/front split
of LLMEngine gives the same outputs whichever side of a process boundary the core runs on."""

from __future__ import annotations

import time

import pytest

from kvserve.runtime.core.outputs import TokenLogprobs
from kvserve.runtime.engine.core_messages import (
    EngineCoreAbort,
    EngineCoreOutputs,
    EngineCoreRequest,
    MessageCodec,
    MessageType,
    RequestFailure,
    SampleDelta,
    failure_exception,
    failure_message,
)
from kvserve.runtime.errors import EngineDeadError, InvalidParameter, WorkerDiedError
from kvserve.runtime.executor.kv_sizing import PlanRejected
from kvserve.runtime.outputs import EngineStats
from kvserve.runtime.sampling_params import SamplingParams


def _roundtrip(kind: MessageType, body):
    codec = MessageCodec()
    frame = codec.encode(kind, body)
    assert frame[:1] == kind.value
    got_kind, got = codec.decode(frame)
    assert got_kind is kind
    return got


def test_a_request_keeps_its_ids_params_and_arrival():
    params = SamplingParams(
        n=2, temperature=0.7, seed=5, max_tokens=9, stop=["\n\n", "END"], logprobs=3, stop_token_ids=[7]
    ).for_sample(1)
    got = _roundtrip(
        MessageType.ADD,
        EngineCoreRequest.make("r1#1", [1, 2, 3], params, 12.5, client_index=1, count_prompt_tokens=False),
    )
    assert (got.request_id, got.prompt_token_ids, got.arrival_time, got.client_index, got.count_prompt_tokens) == (
        "r1#1",
        [1, 2, 3],
        12.5,
        1,
        False,
    )
    assert got.sampling_params == params and got.sampling_params.stop_strings == ["\n\n", "END"]
    assert (got.sampling_params.n, got.sampling_params.seed) == (1, 6)
    assert _roundtrip(MessageType.ADD, EngineCoreRequest.make("r2", [1], params, 1.0)).count_prompt_tokens


def test_outputs_carry_deltas_logprobs_failures_and_stats():
    stats = EngineStats(3, 1, 0.25, 10, 40, 100, 200, 2, 64, 32, num_swap_outs=1)
    body = EngineCoreOutputs(
        deltas=[
            SampleDelta("a", [5]),
            SampleDelta("b#1", [6], [TokenLogprobs(6, -0.5, 1, [(6, -0.5), (9, -1.5)])], "stop", 2),
        ],
        failures=[RequestFailure("c", "sampling failed", False)],
        first_scheduled=[("a", 1.25)],
        stats=stats,
        num_step_failures=4,
    )
    got = _roundtrip(MessageType.OUTPUTS, body)
    assert got == body
    assert got.deltas[1].new_logprobs[0].top == [(6, -0.5), (9, -1.5)]


def test_an_abort_names_aborted_and_stopped_requests():
    assert _roundtrip(MessageType.ABORT, EngineCoreAbort(["x#0"])) == EngineCoreAbort(["x#0"], [])
    assert _roundtrip(MessageType.ABORT, EngineCoreAbort([], ["y#1"])).stopped_ids == ["y#1"]


@pytest.mark.parametrize(
    "exc",
    [
        WorkerDiedError("rank 1 died", rank=1),
        EngineDeadError("too many failed steps"),
        InvalidParameter("max_model_len", "does not fit"),
        PlanRejected("kv_cache_bytes", "one max_model_len sequence needs 9 blocks"),
    ],
)
def test_the_cause_of_death_crosses_with_its_type(exc):
    got = failure_exception(_roundtrip(MessageType.STARTUP_FAILED, failure_message(exc)), RuntimeError)
    assert type(got) is type(exc) and str(got) == str(exc)
    assert getattr(got, "param", None) == getattr(exc, "param", None)


def test_an_exception_that_cannot_cross_becomes_the_fallback_with_its_text():
    class Local(Exception):
        pass

    got = failure_exception(_roundtrip(MessageType.DEAD, failure_message(Local("boom"))), EngineDeadError)
    assert isinstance(got, EngineDeadError) and "boom" in str(got)


def test_the_core_process_gives_the_in_process_engines_outputs(tmp_path):
    """Greedy, seeded sampling, n=2, stop strings and logprobs: CoreClient == LLMEngine, token for token."""
    from kvserve.runtime.demo_model import ensure_demo_model
    from kvserve.runtime.engine.core_client import CoreClient
    from kvserve.runtime.engine.llm_engine import LLMEngine

    model = str(ensure_demo_model(tmp_path))
    kwargs = dict(kv_cache_bytes=8 << 20, max_model_len=512, max_num_seqs=8, seed=0)
    requests = [
        ("greedy", "hello there", SamplingParams(max_tokens=24, temperature=0)),
        ("seeded", "once upon", SamplingParams(max_tokens=16, temperature=1.0, seed=3, n=2, logprobs=2)),
        ("ids", [5, 6, 7, 8], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)),
    ]

    def run(engine) -> dict:
        for rid, prompt, params in requests:
            engine.add_request(rid, prompt, params)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = [(c.token_ids, c.text, c.finish_reason) for c in out.outputs]
        return done

    expected = run(LLMEngine.from_kwargs(model, **kwargs))
    client = CoreClient.from_kwargs(model, **kwargs)
    try:
        got = run(client)
        # a stop string found by the front: cut there, and the core frees the sample
        text = expected["greedy"][0][1]
        stop = text[4:7]
        client.add_request("stopped", "hello there", SamplingParams(max_tokens=24, temperature=0, stop=[stop]))
        stopped = None
        while client.has_unfinished_requests():
            for out in client.step():
                stopped = out
        deadline = time.monotonic() + 10
        while client.stats.num_requests_running and time.monotonic() < deadline:
            client.check_health()  # applies the stats the core sends after the stop
            time.sleep(0.05)
    finally:
        client.shutdown()
    assert got == expected
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].text == text[: text.index(stop)]
    assert client.stats.num_requests_running == 0
    assert not client.proc.is_alive() and client.proc.exitcode == 0

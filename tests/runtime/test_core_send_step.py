"""The engine-core loop's step messages to the API servers (runtime/engine/core_process._send_step): a step with
nothing for anyone and unchanged stats is not sent (a P/D prefill engine holding leases steps every few ms only to
poll NIXL); anything new -- a token, a failure, a first schedule, changed stats or failure count -- is."""

from __future__ import annotations

import dataclasses

from kvserve.runtime.engine.core_messages import (
    EngineCoreOutputs,
    MessageCodec,
    MessageType,
    RequestFailure,
    SampleDelta,
)
from kvserve.runtime.engine.core_process import _send_step
from kvserve.runtime.outputs import EngineStats


class _Socket:
    def __init__(self):
        self.sent: list[EngineCoreOutputs] = []
        self.codec = MessageCodec()

    def send(self, frame, copy=True):
        kind, body = self.codec.decode(frame)
        assert kind is MessageType.OUTPUTS
        self.sent.append(body)


class _Core:
    def __init__(self):
        self.stats = EngineStats(0, 0, 0.0, 100, 100, 0, 0, 0, 0, 0)

    def get_stats(self):
        return self.stats

    def is_unfinished(self, request_id):
        return True


def test_idle_steps_with_unchanged_stats_are_not_sent():
    core, sock, codec, last = _Core(), _Socket(), MessageCodec(), {}
    send = lambda step, failures=None: _send_step(core, step, failures or [[]], {}, [sock], codec, last)  # noqa: E731
    send(EngineCoreOutputs())
    assert len(sock.sent) == 1  # the first message always goes (the servers have no stats yet)
    for _ in range(5):
        send(EngineCoreOutputs())
    assert len(sock.sent) == 1, "idle steps with the same stats were sent"
    send(EngineCoreOutputs(deltas=[SampleDelta("a", [5])]))
    send(EngineCoreOutputs(first_scheduled=[("b", 1.0)]))
    send(EngineCoreOutputs(num_step_failures=1))
    assert len(sock.sent) == 4
    core.stats = dataclasses.replace(core.stats, num_requests_waiting=1)  # e.g. an abort while idle
    send(EngineCoreOutputs())
    assert len(sock.sent) == 5 and sock.sent[-1].stats.num_requests_waiting == 1

    send(EngineCoreOutputs(), [[RequestFailure("c", "refused", False)]])
    assert len(sock.sent) == 6 and sock.sent[-1].failures[0].request_id == "c"
    send(EngineCoreOutputs())
    assert len(sock.sent) == 6

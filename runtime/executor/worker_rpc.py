"""The calls the MultiprocExecutor sends its rank workers (tp_worker.py), and their replies: one typed message
per call, pickled once and sent to every rank over its pipe (or, for a rank on another node, its TCP
connection: executor/multinode.py). Each rank answers every call, in order, with a `Reply` -- or with one
`WorkerFailure`, after which it exits."""

from __future__ import annotations

from typing import Any, Union

import msgspec

from kvserve.runtime.core.outputs import SchedulerOutput


class Execute(msgspec.Struct, frozen=True):
    """Run one step. The sampling rank replies with the ModelRunnerOutput, the others with None."""

    sched: SchedulerOutput


class ExecuteIntervals(msgspec.Struct, frozen=True):
    """Reply: (start, end) time.monotonic() of the rank's latest executes (up to 1024), oldest first."""


class DescribeRank(msgspec.Struct, frozen=True):
    """Reply: the rank's RankInfo (executor/rank_info.py), measured now."""


class LoraDescribe(msgspec.Struct, frozen=True):
    """Reply: the rank's LoraRankState (executor/lora_calls.py)."""


class LoraAdd(msgspec.Struct, frozen=True):
    adapter: Any  # a LoraAdapter with its weights, read and checked once by the core (lora/adapter.py)


class LoraRemove(msgspec.Struct, frozen=True):
    name: str


class Sleep(msgspec.Struct, frozen=True):
    """--enable-sleep-mode: free the rank's KV cache (and, at level 2, its weights); replies None."""

    level: int


class WakeUp(msgspec.Struct, frozen=True):
    """Undo Sleep (weights back or re-read, a fresh KV cache); replies None."""


class Shutdown(msgspec.Struct, frozen=True):
    """Exit cleanly (the rank replies None first)."""


WorkerCall = Union[Execute, ExecuteIntervals, DescribeRank, LoraDescribe, LoraAdd, LoraRemove, Sleep, WakeUp, Shutdown]


class Reply(msgspec.Struct, frozen=True):
    value: Any


class WorkerFailure(msgspec.Struct, frozen=True):
    """The rank failed (starting or in a call) and is exiting; the group is out of step."""

    summary: str  # "ExceptionType: message"
    traceback: str
    param: str | None  # the request/config field to blame (InvalidParameter.param), if any
    message: str

"""Requests held while a model has no ready replica (scale from zero, a rollout of the last replica).

KEDA's HTTP add-on and llm-d's flow control do the same in front of a workload at zero replicas: the request
waits instead of failing, and the number waiting is the demand the autoscaler sees. Here each model (the
request body's "model"; "" when absent) has a FIFO of at most `max_per_model` waiters, each waiting at most
`timeout_s`; `release()` wakes every waiter in arrival order once a replica is ready. Pure asyncio, no I/O:
the proxy decides when to hold and when to release.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

# Distinct model names held at once. The names come from clients and become metric labels: a bound keeps a
# client that invents names from growing the router's memory and Prometheus series without limit.
MAX_HELD_MODELS = 32


class HoldRejected(Exception):
    """The request cannot be held (`reason`: queue_full, too_many_models) or waited too long (hold_timeout)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message


@dataclass
class _Waiter:
    model: str
    future: asyncio.Future = field(repr=False)


class HeldRequests:
    def __init__(
        self,
        max_per_model: int,
        timeout_s: float,
        max_models: int = MAX_HELD_MODELS,
        on_change: Callable[[int], None] | None = None,
    ):
        if max_per_model < 1 or timeout_s <= 0:
            raise ValueError(f"need max_per_model >= 1 and timeout_s > 0, got {max_per_model}, {timeout_s}")
        self.max_per_model, self.timeout_s, self.max_models = max_per_model, timeout_s, max_models
        self.on_change = on_change  # called with the number held after every change (the metric)
        self._fifo: deque[_Waiter] = deque()  # one queue for all models: release keeps the global arrival order
        self._counts: dict[str, int] = {}

    def count(self, model: str) -> int:
        return self._counts.get(model, 0)

    def counts(self) -> dict[str, int]:
        return dict(self._counts)

    def __len__(self) -> int:
        return len(self._fifo)

    async def wait(self, model: str, deadline: float, ready: Callable[[], bool] = lambda: False) -> float:
        """Wait until `release()` (returns the seconds held) or `deadline` (time.monotonic(); raises
        HoldRejected('hold_timeout')). A full queue raises HoldRejected at once. Cancelling (the client
        left) removes the waiter. `ready` is checked in the same step as the waiter is queued, so a release
        that happened just before cannot be missed (then this returns 0.0 at once)."""
        if ready():
            return 0.0
        if self.count(model) >= self.max_per_model:
            raise HoldRejected(
                "queue_full",
                f"no replica of model {model!r} is ready and {self.max_per_model} requests are already "
                "waiting for one (--max-held-requests)",
            )
        if model not in self._counts and len(self._counts) >= self.max_models:
            raise HoldRejected(
                "too_many_models", f"requests for {len(self._counts)} models are already waiting for a replica"
            )
        waiter = _Waiter(model, asyncio.get_running_loop().create_future())
        self._fifo.append(waiter)
        self._counts[model] = self.count(model) + 1
        self._changed()
        started = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout=max(0.0, deadline - started))
        except asyncio.TimeoutError:
            raise HoldRejected(
                "hold_timeout",
                f"no replica of model {model!r} became ready within {self.timeout_s:g} s (--hold-timeout)",
            ) from None
        finally:
            self._forget(waiter)
        return time.monotonic() - started

    def release(self) -> int:
        """Wake every waiter, oldest first (asyncio resumes them in this order); returns how many."""
        woken, popped = 0, bool(self._fifo)
        while self._fifo:
            waiter = self._fifo.popleft()
            self._uncount(waiter.model)
            if not waiter.future.done():
                waiter.future.set_result(None)
                woken += 1
        if popped:
            self._changed()
        return woken

    def _forget(self, waiter: _Waiter) -> None:
        try:
            self._fifo.remove(waiter)  # still queued: timed out or cancelled (release already popped it)
        except ValueError:
            return
        self._uncount(waiter.model)
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(len(self._fifo))

    def _uncount(self, model: str) -> None:
        n = self._counts.get(model, 0) - 1
        if n > 0:
            self._counts[model] = n
        else:
            self._counts.pop(model, None)

"""Errors of the tensor-parallel executor (no torch import: the async server checks for them)."""
from __future__ import annotations


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process died, failed or stopped answering. Fatal for the engine: the
    ranks' collectives can no longer be kept in step, so every worker is shut down and each later step raises
    this same error. The message names the rank, its pid and exit code (or the worker's exception)."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank

    def __reduce__(self):
        return (WorkerDiedError, (str(self), self.rank))

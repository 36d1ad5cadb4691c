"""How the engine fails, as data and exceptions every layer shares (engine step, async front, HTTP, and --
later -- an engine-core process boundary; all of it pickles).

- `RequestError`: one request failed inside the engine. `retryable=False`: something specific to it failed
  (sampling, penalties, logprobs, detokenisation, stop checks) -- HTTP 500 for it alone. `retryable=True`:
  a step failed in a way no single request explains (the forward), so every request in that step failed --
  HTTP 503, the same request may well succeed when sent again.
- `RequestFailedError`: the exception a caller sees for a RequestError.
- `EngineDeadError`: the engine cannot serve any more (a tensor-parallel worker died, or
  max_consecutive_step_failures steps failed in a row). Every in-flight and queued request gets it.
Messages are written for clients: they never carry Python reprs or tracebacks (those go to the log).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestError:
    message: str
    retryable: bool


class RequestFailedError(RuntimeError):
    """The engine could not finish this request (not the client's fault)."""

    def __init__(self, message: str, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable

    @classmethod
    def from_error(cls, error: RequestError) -> "RequestFailedError":
        return cls(error.message, error.retryable)

    def __reduce__(self):
        return (type(self), (str(self), self.retryable))


class EngineDeadError(RequestFailedError):
    """The engine has stopped for good; retry on another replica (this process exits once it answered)."""

    def __init__(self, message: str, retryable: bool = True):
        super().__init__(message, retryable=True)


def request_failed(stage: str) -> RequestError:
    """The error of one request whose own processing raised at `stage` (the details are in the log)."""
    return RequestError(f"the engine failed while {stage} for this request; it was stopped and its resources "
                        "freed (server-side error, see the server log)", retryable=False)


STEP_FAILED = RequestError("the engine step running this request failed (server-side error, see the server log); "
                           "the request was stopped and can be retried", retryable=True)

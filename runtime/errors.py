"""How the engine fails: the one error taxonomy every layer shares (executor, engine step, async front, HTTP,
the engine-core process boundary; all of it pickles, none of it imports torch).

- `InvalidParameter`: a request or setting is refused before any work starts; `param` names the field.
- `RequestError`: one request failed inside the engine. `retryable=False`: something specific to it failed
  (sampling, penalties, logprobs, detokenisation, stop checks) -- HTTP 500 for it alone. `retryable=True`:
  a step failed in a way no single request explains (the forward), so every request in that step failed --
  HTTP 503, the same request may well succeed when sent again.
- `RequestFailedError`: the exception a caller sees for a RequestError.
- `EngineDeadError`: the engine cannot serve any more (a tensor-parallel worker died, or
  max_consecutive_step_failures steps failed in a row). Every in-flight and queued request gets it.
- `WorkerDiedError`: the executor's own report that a tensor-parallel worker died (the engine turns it into
  EngineDeadError).
Messages are written for clients: they never carry Python reprs or tracebacks (those go to the log).
"""

from __future__ import annotations

import json
from dataclasses import dataclass


class InvalidParameter(ValueError):
    """A request or engine parameter is invalid (the client's or the operator's fault, never the engine's).
    `param` names the field: OpenAI error bodies carry it, and the CLI prints it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def json_object(value: str | dict, field: str) -> dict:
    """A vLLM-style JSON flag's value (--kv-events-config, --kv-transfer-config: a JSON string, or a dict from
    LLM(...)) as a dict; InvalidParameter naming `field` when it is not JSON or not an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidParameter(field, f"{field} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidParameter(field, f"{field} must be a JSON object, got {type(value).__name__}")
    return value


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
    return RequestError(
        f"the engine failed while {stage} for this request; it was stopped and its resources "
        "freed (server-side error, see the server log)",
        retryable=False,
    )


STEP_FAILED = RequestError(
    "the engine step running this request failed (server-side error, see the server log); "
    "the request was stopped and can be retried",
    retryable=True,
)


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process died, failed or stopped answering. Fatal for the engine: the
    ranks' collectives can no longer be kept in step, so every worker is shut down and each later step raises
    this same error. The message names the rank, its pid and exit code (or the worker's exception)."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank

    def __reduce__(self):
        return (WorkerDiedError, (str(self), self.rank))

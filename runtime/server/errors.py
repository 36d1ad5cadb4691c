"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return error_response(
            self.status, self.message, type=self.type, param=self.param, code=self.code, headers=self.headers
        )


def error_response(
    status: int,
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def engine_error(exc: Any) -> APIError:
    """The HTTP error for a request the engine failed (engine/errors.py): 503 + Retry-After when retrying can
    succeed (a failed step; a dead engine -- retry on another replica), 500 when its own processing failed."""
    from kvserve.runtime.errors import EngineDeadError

    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="server_error", code="engine_dead", headers={"Retry-After": "1"})
    if getattr(exc, "retryable", False):
        return APIError(503, str(exc), type="server_error", code="engine_step_failed", headers={"Retry-After": "1"})
    return APIError(500, str(exc), type="server_error", code="internal_error")


def find_invalid_text(data: Any, path: str = "") -> str | None:
    """The dotted path of the first string (value or key) in parsed JSON that is not valid Unicode -- JSON
    can carry lone surrogate escapes ("\\ud800") that no tokenizer can encode -- or None if all are valid."""
    stack = [(data, path)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return where
        elif isinstance(value, dict):
            for key, item in value.items():
                child = f"{where}.{key}" if where else str(key)
                try:
                    key.encode("utf-8")
                except UnicodeEncodeError:
                    return where
                stack.append((item, child))
        elif isinstance(value, list):
            stack.extend((item, f"{where}.{i}") for i, item in enumerate(value))
    return None


def from_validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error, named by its dotted field path (`messages.0.role`)."""
    errors = exc.errors(include_url=False)
    first: dict[str, Any] = errors[0] if errors else {"loc": (), "msg": str(exc)}
    # Drop union-member tags pydantic inserts into the location (`str`, `list[int]`, ...).
    loc = [str(p) for p in first.get("loc", ()) if not _is_type_tag(p)]
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return APIError(400, message, param=param, code="invalid_value")


def _is_type_tag(part: Any) -> bool:
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bool", "list", "dict", "none")
        or part.startswith(("list[", "dict[", "constrained-", "function-", "literal[", "tagged-union["))
        or part in ("TextContentPart", "StreamOptions", "ChatMessage")
    )

"""The error a LoRA load/unload request is refused with (torch-free: the API server raises it too)."""

from __future__ import annotations


class LoraRequestError(Exception):
    """A load/unload request refused: HTTP status, the request field to blame, an OpenAI-style code."""

    def __init__(self, status: int, param: str | None, code: str, message: str):
        super().__init__(message)
        self.status, self.param, self.code, self.message = status, param, code, message

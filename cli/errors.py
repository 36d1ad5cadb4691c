"""The CLI's one error type: `kvserve` prints its message as one line on stderr and exits non-zero
(`kvserve --debug ...` also prints the traceback)."""

from __future__ import annotations


class CLIError(Exception):
    """An ordinary user error (missing file, bad YAML, unknown field, port in use): one line, no traceback."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code

"""What a request constrains its output to, validated at the edge (pure Python, no xgrammar, no torch).

One spec per request: exactly one of json (a JSON schema), json_object, regex, choice or grammar (EBNF, the
GBNF dialect xgrammar reads). The field names follow vLLM's `structured_outputs` request extension; OpenAI's
`response_format` maps onto `json` / `json_object` (runtime/server/structured.py)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from kvserve.runtime.errors import InvalidParameter

MAX_SPEC_BYTES = 64 * 1024  # a schema / regex / grammar larger than this is refused (compile time grows with it)
MAX_CHOICES = 256
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputSpec:
    kind: str  # one of KINDS
    value: str  # JSON text of the schema, the regex, the grammar, or a JSON list of choices ("" for json_object)
    field: str = "structured_outputs"  # the request field it came from (errors name it)

    @property
    def key(self) -> str:
        """Cache key of the compiled grammar."""
        return self.kind + ":" + hashlib.sha256(self.value.encode()).hexdigest()

    @classmethod
    def from_request(cls, kind: str, value: Any, field: str) -> "StructuredOutputSpec":
        if kind not in KINDS:
            raise InvalidParameter(field, f"{field}: unknown constraint {kind!r}; one of {', '.join(KINDS)}")
        if kind == "json_object":
            return cls(kind, "", field)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise InvalidParameter(field, f"{field}: the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(value, (dict, bool)):
                raise InvalidParameter(field, f"{field}: a JSON schema must be an object")
            text = json.dumps(value, sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise InvalidParameter(field, f"{field}: choice must be a non-empty list of non-empty strings")
            if len(value) > MAX_CHOICES:
                raise InvalidParameter(field, f"{field}: at most {MAX_CHOICES} choices")
            text = json.dumps(value)
        else:  # regex, grammar
            if not isinstance(value, str) or not value.strip():
                raise InvalidParameter(field, f"{field}: {kind} must be a non-empty string")
            text = value
        if len(text.encode()) > MAX_SPEC_BYTES:
            raise InvalidParameter(
                field, f"{field}: the {kind} is {len(text.encode())} bytes; at most {MAX_SPEC_BYTES}"
            )
        return cls(kind, text, field)

"""JSON-schema preparation before xgrammar compiles it, so constrained generation always finishes.

Two rules (issue 27):
- A `number`/`integer` with no `minimum`/`maximum` would let the grammar grow a number digit after digit
  until max_tokens; we add a symmetric bound of `max_number_digits` integer digits (xgrammar then also caps
  the fraction at 6 digits). A bound the schema gives itself is kept as is.
- A keyword xgrammar cannot express (it would silently drop it and generate under a looser grammar) is
  refused with a 400 naming the keyword and where it is (a JSON pointer)."""

from __future__ import annotations

import copy
import re
from typing import Any

from kvserve.runtime import engine_args
from kvserve.runtime.errors import InvalidParameter

# --structured-output-max-number-digits (engine_args, its one home; 9: up to 999,999,999, enough for counts and
# ids, short enough to always close)
DEFAULT_MAX_NUMBER_DIGITS = engine_args.default("structured_output_max_number_digits")
# Keywords xgrammar's JSON-schema converter (0.1.x) ignores: each was checked by compiling a schema with and without
# it (the grammar comes out the same, or for `not` an equivalent one; `contains` only lifts minItems to 1). Refusing
# beats a silently looser grammar. It does express multipleOf, min/maxProperties, exclusive bounds and format.
UNSUPPORTED_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "dependentSchemas",
    "dependentRequired",
    "dependencies",
    "unevaluatedProperties",
    "unevaluatedItems",
    "contains",
    "propertyNames",
)
# Regex constructs xgrammar's regex converter lacks: lookaround and backreferences.
_UNSUPPORTED_PATTERN = re.compile(r"\(\?<=|\(\?<!|\(\?=|\(\?!|\\[1-9]")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalProperties")


def prepare_schema(schema: Any, field: str, max_number_digits: int = DEFAULT_MAX_NUMBER_DIGITS) -> Any:
    """A copy of `schema` with unbounded numbers bounded; raises InvalidParameter for unsupported keywords."""
    out = copy.deepcopy(schema)
    _walk(out, field, "#", max_number_digits)
    return out


def _walk(node: Any, field: str, where: str, digits: int) -> None:
    if not isinstance(node, dict):
        return
    for keyword in UNSUPPORTED_KEYWORDS:
        if keyword in node:
            raise InvalidParameter(
                field, f"{field}: the JSON-schema keyword {keyword!r} (at {where}) is not supported by the grammar"
            )
    if node.get("uniqueItems") is True:  # ignored by the grammar too; uniqueItems: false constrains nothing
        raise InvalidParameter(
            field, f"{field}: the JSON-schema keyword 'uniqueItems' (at {where}) is not supported by the grammar"
        )
    pattern = node.get("pattern")
    if isinstance(pattern, str) and _UNSUPPORTED_PATTERN.search(pattern):
        raise InvalidParameter(
            field,
            f"{field}: the JSON-schema keyword 'pattern' (at {where}) uses lookaround or a backreference, "
            "which the grammar cannot express",
        )
    types = node.get("type")
    types = types if isinstance(types, list) else [types]
    if "integer" in types or "number" in types:
        limit = 10**digits - 1
        has_low = "minimum" in node or "exclusiveMinimum" in node
        has_high = "maximum" in node or "exclusiveMaximum" in node
        if not has_low:
            node["minimum"] = -limit
        if not has_high:
            node["maximum"] = limit
    for key in _SUBSCHEMA_MAPS:
        sub = node.get(key)
        if isinstance(sub, dict):
            for name, child in sub.items():
                _walk(child, field, f"{where}/{key}/{name}", digits)
    for key in _SUBSCHEMA_LISTS:
        sub = node.get(key)
        if isinstance(sub, list):
            for i, child in enumerate(sub):
                _walk(child, field, f"{where}/{key}/{i}", digits)
    for key in _SUBSCHEMA_ONE:
        _walk(node.get(key), field, f"{where}/{key}", digits)

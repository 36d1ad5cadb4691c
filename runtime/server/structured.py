"""The OpenAI surface of structured outputs and tool calling, between the request body and the engine.

Request fields (every unsupported combination is a 400 naming the field):
- `response_format`: {"type": "text"} | {"type": "json_object"} | {"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}} (completions too, as vLLM accepts it there);
- vLLM's extensions: `structured_outputs` {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
  and the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
- chat `tools` + `tool_choice` (none | auto | required | {"type": "function", "function": {"name"}}) +
  `parallel_tool_calls`. The chat template renders the tools. `required` and a named function are
  enforced by a grammar (vLLM's approach): `required` generates a JSON array of {"name", "parameters"}
  objects (one item unless parallel_tool_calls), a named function generates its arguments object. `auto`
  lets the model write its native format, parsed afterwards by `--tool-call-parser` (tool_parsers.py).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvserve.runtime.errors import InvalidParameter
from kvserve.runtime.server.errors import bad_request
from kvserve.runtime.structured_output.spec import StructuredOutputSpec

MAX_TOOLS = 128
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclass
class ToolPlan:
    """How a chat request's output becomes tool calls."""

    mode: str = "none"  # none | auto | required | named
    tools: list[dict] = field(default_factory=list)  # OpenAI tool objects, for the chat template
    function_name: str | None = None  # mode "named"
    parallel: bool = True
    parser: Any = None  # a tool_parsers.ToolParser for mode "auto"

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")


def _spec(kind: str, value: Any, field_name: str) -> StructuredOutputSpec:
    try:
        return StructuredOutputSpec.from_request(kind, value, field_name)
    except InvalidParameter as exc:
        raise bad_request(str(exc), param=exc.param) from None


def output_spec(body: Any) -> StructuredOutputSpec | None:
    """The one structured-output constraint the body asks for (None: free text)."""
    found: list[StructuredOutputSpec] = []
    fmt = getattr(body, "response_format", None)
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise bad_request(
                "response_format.type must be one of text, json_object, json_schema.", param="response_format.type"
            )
        if fmt["type"] == "json_object":
            found.append(_spec("json_object", None, "response_format"))
        elif fmt["type"] == "json_schema":
            js = fmt.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("name", ""), str):
                raise bad_request(
                    "response_format.json_schema must be an object with a name and a schema.",
                    param="response_format.json_schema",
                )
            schema = js.get("schema", {"type": "object"})
            found.append(_spec("json", schema, "response_format.json_schema.schema"))
    extension = getattr(body, "structured_outputs", None)
    if extension is not None:
        if not isinstance(extension, dict):
            raise bad_request("structured_outputs must be an object.", param="structured_outputs")
        keys = [k for k, v in extension.items() if v not in (None, False)]
        if len(keys) != 1:
            raise bad_request(
                "structured_outputs needs exactly one of json, json_object, regex, choice, grammar.",
                param="structured_outputs",
            )
        found.append(_spec(keys[0], extension[keys[0]], f"structured_outputs.{keys[0]}"))
    for name, kind in _GUIDED.items():
        value = getattr(body, name, None)
        if value is not None:
            found.append(_spec(kind, value, name))
    if len(found) > 1:
        raise bad_request(
            "give at most one of response_format (json), structured_outputs and guided_*.", param=found[1].field
        )
    return found[0] if found else None


def tool_plan(body: Any, parser_name: str | None) -> ToolPlan:
    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools.", param="tool_choice")
        return ToolPlan()
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"at most {MAX_TOOLS} tools.", param="tools")
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not fn["name"]
        ):
            raise bad_request('each tool must be {"type": "function", "function": {"name": ...}}.', param=f"tools.{i}")
        if not isinstance(fn.get("parameters", {}), dict):
            raise bad_request(
                "function.parameters must be a JSON schema object.", param=f"tools.{i}.function.parameters"
            )
        names.append(fn["name"])
    if len(set(names)) != len(names):
        raise bad_request("tool function names must be unique.", param="tools")
    parallel = True if body.parallel_tool_calls is None else bool(body.parallel_tool_calls)
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise bad_request(f"tool_choice names a function that is not in tools: {name!r}.", param="tool_choice")
        return ToolPlan("named", tools, name, parallel)
    if choice == "none":
        return ToolPlan("none", [], None, parallel)
    if choice == "required":
        return ToolPlan("required", tools, None, parallel)
    if choice == "auto":
        if parser_name is None:
            raise bad_request(
                '"auto" tool choice requires the server to run with --tool-call-parser '
                '(hermes or llama3_json); use tool_choice "required" or a named function otherwise.',
                param="tool_choice",
            )
        from kvserve.runtime.server.tool_parsers import get_parser

        return ToolPlan("auto", tools, None, parallel, get_parser(parser_name))
    raise bad_request('tool_choice must be none, auto, required or {"type": "function", ...}.', param="tool_choice")


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def tool_spec(plan: ToolPlan) -> StructuredOutputSpec | None:
    """The grammar that enforces `required` / a named function (None for none/auto)."""
    if plan.mode == "named":
        tool = next(t for t in plan.tools if t["function"]["name"] == plan.function_name)
        return _spec("json", _parameters(tool), "tool_choice")
    if plan.mode == "required":
        call = {
            "anyOf": [
                {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name", "parameters"],
                    "properties": {"name": {"const": t["function"]["name"]}, "parameters": _parameters(t)},
                }
                for t in plan.tools
            ]
        }
        schema = {"type": "array", "items": call, "minItems": 1}
        if not plan.parallel:
            schema["maxItems"] = 1
        return _spec("json", schema, "tools")
    return None


def _call(name: str, arguments: Any) -> dict:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def tool_calls_from_output(plan: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) for a finished choice."""
    if plan.mode == "named":
        return None, [_call(plan.function_name, text)]
    if plan.mode == "required":
        try:
            calls = json.loads(text)
        except ValueError:  # cut by max_tokens before the grammar completed: no calls, the text as content
            return text, []
        return None, [_call(c["name"], c["parameters"]) for c in calls]
    if plan.mode == "auto":
        content, calls = plan.parser.parse(text)
        if not plan.parallel:
            calls = calls[:1]
        return content, [_call(name, args) for name, args in calls]
    return text, []

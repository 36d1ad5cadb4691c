"""Request bodies of the OpenAI-compatible API (pydantic v2), validated once at the HTTP edge.

Unknown fields are ignored (new OpenAI client versions add fields); known fields are type-checked, and
each error names the field. Non-OpenAI sampling extras (`top_k`, `min_p`, `repetition_penalty`,
`ignore_eos`, `min_tokens`, ...) come in through the openai client's `extra_body`, as with vLLM.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

MAX_N = 64  # samples per prompt; more cannot run concurrently on any sensible batch size
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20

NonNegInt = Annotated[StrictInt, Field(ge=0)]
Number = Union[StrictInt, float]  # JSON numbers; strings such as "0.5" are rejected


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class StreamOptions(_Base):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _SamplingFields(_Base):
    """Fields shared by completions and chat completions."""
    model: StrictStr | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    best_of: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    seed: StrictInt | None = None
    user: StrictStr | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM / kvserve extras
    top_k: StrictInt | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=2)] | None = None
    ignore_eos: StrictBool = False
    min_tokens: NonNegInt = 0
    stop_token_ids: list[NonNegInt] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    # Structured outputs (runtime/server/structured.py validates the contents and names the field)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None

    @field_validator("temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p", "repetition_penalty",
                     mode="before")
    @classmethod
    def _number_not_string(cls, value: Any) -> Any:
        if isinstance(value, (str, bool)):
            raise ValueError("must be a number")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and value < -1:
            raise ValueError("must be -1 (disabled), 0 (disabled) or >= 1")
        return value


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | list[StrictStr] | list[NonNegInt] | list[list[NonNegInt]]
    max_tokens: StrictInt | None = 16
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("must not be empty")
        if isinstance(value, list) and len(value) > MAX_N and not isinstance(value[0], int):
            raise ValueError(f"at most {MAX_N} prompts per request")
        return value


class TextContentPart(_Base):
    type: Literal["text"]
    text: StrictStr


class ToolCallFunction(_Base):
    name: StrictStr
    arguments: StrictStr | dict[str, Any] = "{}"


class ToolCall(_Base):
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=128)] | None = None  # assistant turns in the history
    tool_call_id: StrictStr | None = None  # tool turns

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it (tool-call arguments as objects, as HF templates do)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _maybe_json(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: StrictBool = True
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None


class TokenizeRequest(_Base):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(_Base):
    model: StrictStr | None = None
    tokens: list[NonNegInt]


def _maybe_json(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments

"""Request bodies of the OpenAI-compatible API (pydantic v2), validated once at the HTTP edge.

Unknown fields are ignored (new OpenAI client versions add fields); known fields are type-checked, and
each error names the field. Non-OpenAI sampling extras (`top_k`, `min_p`, `repetition_penalty`,
`ignore_eos`, `min_tokens`, ...) come in through the openai client's `extra_body`, as with vLLM.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationInfo, field_validator

# The bounds are SamplingParams' (one source); what depends on the model (vocabulary, context length,
# max_num_seqs, KV pool) is checked by sampling_params.verify_request once the prompt is tokenized.
from kvserve.runtime.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROBS,
    MAX_N,
    MAX_PROMPTS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)

TokenId = Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]
StopString = Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Number = Union[StrictInt, float]  # JSON numbers; strings such as "0.5" are rejected


# The sampling defaults have one home, SamplingParams: the request models show the same values (so the OpenAPI
# schema documents them), and the server passes on only the fields a client set (serving.client_sampling_fields).
_DEFAULT = SamplingParams()


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class StreamOptions(_Base):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _SamplingFields(_Base):
    """Fields shared by completions and chat completions."""

    model: StrictStr | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = _DEFAULT.n
    best_of: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = _DEFAULT.presence_penalty
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = _DEFAULT.frequency_penalty
    seed: Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    user: StrictStr | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM / kvserve extras
    top_k: StrictInt | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=2)] | None = None
    ignore_eos: StrictBool = _DEFAULT.ignore_eos
    min_tokens: Annotated[StrictInt, Field(ge=0, le=INT64_MAX)] = _DEFAULT.min_tokens
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: StrictBool = _DEFAULT.skip_special_tokens
    include_stop_str_in_output: StrictBool = _DEFAULT.include_stop_str_in_output
    # Beam search (vLLM's extra fields; `n` is the beam width; early_stopping as HF: true, false, "never")
    use_beam_search: StrictBool = False
    length_penalty: float = 1.0
    early_stopping: StrictBool | Literal["never"] = False
    # Structured outputs (runtime/server/structured.py validates the contents and names the field)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    # P/D disaggregation (vLLM's field; sampling_params.py checks the contents, docs/disaggregation.md)
    kv_transfer_params: dict[str, Any] | None = None

    @field_validator(
        "temperature",
        "top_p",
        "presence_penalty",
        "frequency_penalty",
        "min_p",
        "repetition_penalty",
        "length_penalty",
        mode="before",
    )
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
    # left_to_right: a list of token ids matches its member first (smart mode would also validate every id
    # against the other list members: 0.4 s of pydantic for a 1 MiB body, with the GIL held).
    prompt: Annotated[
        StrictStr | list[TokenId] | list[StrictStr] | list[list[TokenId]], Field(union_mode="left_to_right")
    ]
    max_tokens: Annotated[StrictInt, Field(le=INT64_MAX)] | None = _DEFAULT.max_tokens  # OpenAI's 16 too
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any, info: ValidationInfo) -> Any:
        """Cheap checks before the per-element validation: sizes only (a 1 MiB token list is refused in
        microseconds). `max_model_len` comes in the validation context when the server has an engine."""
        if not isinstance(value, list):
            return value
        if not value:
            raise ValueError("must not be empty")
        if not isinstance(value[0], int) and len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        max_len = (info.context or {}).get("max_model_len")
        token_lists = [value] if isinstance(value[0], int) else [v for v in value if isinstance(v, list)]
        for ids in token_lists:
            if max_len and len(ids) > max_len:
                raise ValueError(f"has {len(ids)} tokens, longer than max_model_len={max_len}")
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
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _maybe_json(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def _messages_fit_context(cls, value: Any, info: ValidationInfo) -> Any:
    """Refuse more messages than the context holds before validating each one (every turn renders to at
    least one token); `max_model_len` comes in the validation context."""
    max_len = (info.context or {}).get("max_model_len")
    if isinstance(value, list) and max_len and len(value) > max_len:
        raise ValueError(f"{len(value)} messages cannot fit in max_model_len={max_len} tokens")
    return value


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(le=INT64_MAX)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(le=INT64_MAX)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: StrictBool = True
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None

    _messages_fit = field_validator("messages", mode="before")(_messages_fit_context)


class TokenizeRequest(_Base):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True

    _messages_fit = field_validator("messages", mode="before")(_messages_fit_context)


class DetokenizeRequest(_Base):
    model: StrictStr | None = None
    tokens: list[TokenId]


def _maybe_json(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments

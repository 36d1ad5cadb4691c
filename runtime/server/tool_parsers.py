"""Parsers for the tool-call formats models write on their own (`tool_choice: "auto"`, `--tool-call-parser`).

- hermes: Hermes / Qwen 2.5+ / Qwen3 chat templates: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, any text around them is content;
- llama3_json: Llama 3.1+ JSON tool calls: the whole message is `{"name": ..., "parameters": {...}}`
  (optionally after `<|python_tag|>`; several calls separated by `;`).

Each parser also tells the streaming path how much of a partial text is safe to send as content
(`content_prefix_len`): text that may still turn into a tool call is held back."""

from __future__ import annotations

import json
import re
from typing import Any


class ToolParser:
    name = ""

    def parse(self, text: str) -> tuple[str | None, list[tuple[str, Any]]]:
        raise NotImplementedError

    def content_prefix_len(self, text: str) -> int:
        raise NotImplementedError


def _held_back_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> tuple[str | None, list[tuple[str, Any]]]:
        calls = []
        for raw in self._BLOCK.findall(text):
            try:
                obj = json.loads(raw)
            except ValueError:
                return text, []  # not a well-formed call: leave the text as the model wrote it
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return text, []
            calls.append((obj["name"], obj.get("arguments", {})))
        if not calls:
            return text, []
        content = text[: text.find(self.START)].strip()
        return (content or None), calls

    def content_prefix_len(self, text: str) -> int:
        start = text.find(self.START)
        return start if start >= 0 else len(text) - _held_back_suffix(text, self.START)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[tuple[str, Any]]]:
        body = text.strip()
        body = body[len(self.TAG) :] if body.startswith(self.TAG) else body
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return text, []
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return text, []
            calls.append((obj["name"], obj.get("parameters", obj.get("arguments", {}))))
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return None, calls

    def content_prefix_len(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped.startswith("{") or self.TAG.startswith(stripped[: len(self.TAG)]):
            return 0  # may be a tool call: hold everything until the end
        return len(text)


PARSERS = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def get_parser(name: str) -> ToolParser:
    return PARSERS[name]()

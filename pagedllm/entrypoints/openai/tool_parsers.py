"""Tool calls found in a model's free text (``tool_choice: "auto"``), one parser per format.

- ``hermes`` (Hermes, Qwen 2/2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, possibly several, possibly after some prose.
- ``llama3_json`` (Llama 3.1+): the whole reply is ``{"name": ..., "parameters": {...}}`` (or
  ``"arguments"``), several separated by ``;``, optionally after ``<|python_tag|>``.

A parser answers two questions: what are the content and the calls of a finished reply
(``parse``), and, while streaming, how much of the text so far is certainly content
(``content_prefix``): the rest is held back until the reply ends, so a client never receives the
beginning of a tool call as content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it


def _call(obj: Any, args_keys: tuple[str, ...]) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in args_keys:
        if key in obj:
            args = obj[key]
            return ParsedCall(obj["name"], args if isinstance(args, str) else json.dumps(args))
    return ParsedCall(obj["name"], "{}")


class ToolParser:
    name = ""

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        raise NotImplementedError

    def content_prefix(self, text: str) -> int:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = []
        for body in self._BLOCK.findall(text[start:]):
            try:
                call = _call(json.loads(body), ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is None:
                return text, []  # not a well-formed call: the reply stays text
            calls.append(call)
        content = text[:start].strip()
        return (content or None), calls

    def content_prefix(self, text: str) -> int:
        start = text.find(self.START)
        if start >= 0:
            return start
        # Hold back a tail that could be the beginning of the marker.
        for keep in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].strip()
        if not body.startswith("{"):
            return text, []
        decoder = json.JSONDecoder()
        calls: list[ParsedCall] = []
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return text, []
            call = _call(obj, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return None, calls

    def content_prefix(self, text: str) -> int:
        body = text.lstrip()
        if not body:
            return 0
        if body.startswith("{") or self.TAG.startswith(body[: len(self.TAG)]):
            return 0  # may be a call: hold everything
        return len(text)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"tool_call_parser: unknown parser {name!r}; choose one of {sorted(TOOL_PARSERS)}"
        ) from None

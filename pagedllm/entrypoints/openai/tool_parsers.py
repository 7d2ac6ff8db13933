"""Tool calls found in a model's text, one parser per format.

- ``hermes`` (Hermes, Qwen 2/2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, possibly several, possibly after some prose.
- ``llama3_json`` (Llama 3.1+): the whole reply is ``{"name": ..., "parameters": {...}}`` (or
  ``"arguments"``), several separated by ``;``, optionally after ``<|python_tag|>``.
- ``mistral``: ``[TOOL_CALLS]`` and a JSON array of ``{"name", "arguments"}`` objects.
- ``RequiredCallsParser`` (not a ``--tool-call-parser``): the JSON array of
  ``{"name", "arguments"}`` objects that ``tool_choice: "required"`` constrains the reply to.

A parser answers three questions: what are the content and the calls of a finished reply
(``parse``); while streaming, how much of the text so far is certainly content
(``content_prefix``: the rest is held back, so a client never receives the beginning of a tool
call as content); and which calls the text so far has begun (``partial_calls``), so their
arguments stream as they are generated.

A call's ``arguments`` are the JSON text of its arguments value exactly as the model wrote it
(a JSON string value is decoded), so what streams is a prefix of what the finished reply says:
the argument deltas of a stream add up to the arguments of the same reply unstreamed.
"""

from __future__ import annotations

import re

from pagedllm.entrypoints.openai.tool_json import (
    WS,
    ParsedCall,
    PartialCall,
    finished_call,
    partial_call,
    scan_call,
    skip_ws,
)


class ToolParser:
    name = ""
    #: Whether a reply with no call is content (False where the reply is constrained JSON).
    TEXT_IS_CONTENT = True
    ARGS_KEYS: tuple[str, ...] = ("arguments", "parameters")

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        raise NotImplementedError

    def content_prefix(self, text: str) -> int:
        raise NotImplementedError

    def partial_calls(self, text: str) -> list[PartialCall]:
        raise NotImplementedError

    def streamed_content(self, text: str, finished: bool) -> str | None:
        """Content that is not a prefix of the text (a JSON-wrapped answer); None: the text up
        to ``content_prefix`` is the content."""
        return None

    def calls_array(self, text: str) -> tuple[int, str] | None:
        """Where a constrained reply's JSON array of calls opens (its ``[``) and the text that
        closes the reply after any of its calls; None where the reply has none (the formats a
        model writes freely: what it repeats is its own text)."""
        return None


def _before_marker(text: str, marker: str) -> int:
    """How far the text is certainly content: up to ``marker``, holding back a tail that could
    be its beginning."""
    start = text.find(marker)
    if start >= 0:
        return start
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = []
        for block in self._BLOCK.finditer(text, start):
            body = block.group(1)
            found = finished_call(body, 0, self.ARGS_KEYS) if body.startswith("{") else None
            if found is None or found[1] != len(body):
                return text, []  # not a well-formed call: the reply stays text
            calls.append(found[0])
        content = text[:start].strip()
        return (content or None), calls

    def content_prefix(self, text: str) -> int:
        return _before_marker(text, self.START)

    def partial_calls(self, text: str) -> list[PartialCall]:
        calls: list[PartialCall] = []
        marker = text.find(self.START)
        while marker >= 0:
            pos = skip_ws(text, marker + len(self.START))
            if pos >= len(text) or text[pos] != "{":
                break
            scan = scan_call(text, pos, self.ARGS_KEYS)
            calls.append(partial_call(text, scan))
            if scan.end is None:
                break
            marker = text.find(self.START, scan.end)
        return calls


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"
    ARGS_KEYS = ("parameters", "arguments")

    def _body_start(self, text: str) -> int:
        pos = skip_ws(text, 0)
        if text.startswith(self.TAG, pos):
            pos = skip_ws(text, pos + len(self.TAG))
        return pos

    @staticmethod
    def _next(text: str, pos: int) -> int:
        while pos < len(text) and text[pos] in WS + ";":
            pos += 1
        return pos

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.rstrip()
        pos = self._body_start(body)
        if not body.startswith("{", pos):
            return text, []
        calls: list[ParsedCall] = []
        while pos < len(body):
            found = finished_call(body, pos, self.ARGS_KEYS)
            if found is None:
                return text, []
            calls.append(found[0])
            pos = self._next(body, found[1])
        return None, calls

    def content_prefix(self, text: str) -> int:
        body = text.lstrip()
        if not body:
            return 0
        if body.startswith("{") or self.TAG.startswith(body[: len(self.TAG)]):
            return 0  # may be a call: hold everything
        return len(text)

    def partial_calls(self, text: str) -> list[PartialCall]:
        calls: list[PartialCall] = []
        pos = self._body_start(text)
        while text.startswith("{", pos):
            scan = scan_call(text, pos, self.ARGS_KEYS)
            calls.append(partial_call(text, scan))
            if scan.end is None:
                break
            pos = self._next(text, scan.end)
        return calls


class RequiredCallsParser(ToolParser):
    """``tool_choice: "required"``: the reply is a JSON array of calls; none of it is content."""

    name = "required"
    ARGS_KEYS = ("arguments",)
    TEXT_IS_CONTENT = False

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        pos = skip_ws(text, 0)
        if not text.startswith("[", pos):
            return text, []
        calls: list[ParsedCall] = []
        pos = skip_ws(text, pos + 1)
        while text.startswith("{", pos):
            found = finished_call(text, pos, self.ARGS_KEYS)
            if found is None:
                return text, []
            calls.append(found[0])
            pos = skip_ws(text, found[1])
            if text.startswith(",", pos):
                pos = skip_ws(text, pos + 1)
        if not text.startswith("]", pos) or skip_ws(text, pos + 1) != len(text):
            return text, []
        return None, calls

    def content_prefix(self, text: str) -> int:
        return 0

    def calls_array(self, text: str) -> tuple[int, str] | None:
        pos = skip_ws(text, 0)
        return (pos, "]") if text.startswith("[", pos) else None

    def partial_calls(self, text: str) -> list[PartialCall]:
        calls: list[PartialCall] = []
        pos = skip_ws(text, 0)
        if not text.startswith("[", pos):
            return calls
        pos = skip_ws(text, pos + 1)
        while text.startswith("{", pos):
            scan = scan_call(text, pos, self.ARGS_KEYS)
            calls.append(partial_call(text, scan))
            if scan.end is None:
                break
            pos = skip_ws(text, scan.end)
            if not text.startswith(",", pos):
                break
            pos = skip_ws(text, pos + 1)
        return calls


class MistralToolParser(RequiredCallsParser):
    """Mistral: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` objects, possibly
    after some prose."""

    name = "mistral"
    MARKER = "[TOOL_CALLS]"
    TEXT_IS_CONTENT = True

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        start = text.find(self.MARKER)
        if start < 0:
            return text, []
        _, calls = super().parse(text[start + len(self.MARKER) :])
        if not calls:
            return text, []
        return (text[:start].strip() or None), calls

    def content_prefix(self, text: str) -> int:
        return _before_marker(text, self.MARKER)

    def calls_array(self, text: str) -> tuple[int, str] | None:
        return None  # written freely, not constrained

    def partial_calls(self, text: str) -> list[PartialCall]:
        start = text.find(self.MARKER)
        if start < 0:
            return []
        return super().partial_calls(text[start + len(self.MARKER) :])


#: The ``--tool-call-parser`` formats by the name each declares, in the order help texts list
#: them: the CLI's choices and every message naming them come from here.
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"tool_call_parser: unknown parser {name!r}; choose one of {sorted(TOOL_PARSERS)}"
        ) from None

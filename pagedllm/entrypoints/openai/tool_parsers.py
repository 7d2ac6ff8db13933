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

import json
import re
from dataclasses import dataclass

_WS = " \t\r\n"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass(frozen=True)
class PartialCall:
    """A call as far as the text so far goes: ``name`` once its string is closed, ``arguments``
    the argument text so far (complete once ``done``)."""

    name: str | None
    arguments: str
    done: bool


# -- an incremental look at JSON text: where values end, or that they have not ended yet ------
def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def _string_end(text: str, pos: int) -> int | None:
    """Index past the string opening at ``text[pos]``; None while it is not closed."""
    i = pos + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return None


def _value_end(text: str, pos: int) -> int | None:
    """Index past the JSON value starting at ``text[pos]``; None while it may go on."""
    first = text[pos]
    if first == '"':
        return _string_end(text, pos)
    if first in "{[":
        depth, i = 0, pos
        while i < len(text):
            ch = text[i]
            if ch == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    i = pos  # a number, true, false or null: it ends at a delimiter
    while i < len(text) and text[i] not in ",}]" + _WS:
        i += 1
    return i if i < len(text) else None


@dataclass
class _CallScan:
    name: str | None = None
    args_start: int | None = None  # first character of the arguments value
    args_end: int | None = None  # past its last, once complete
    end: int | None = None  # past the object's closing brace, once complete


def _scan_call(text: str, pos: int, args_keys: tuple[str, ...]) -> _CallScan:
    """The call object opening at ``text[pos]`` (``{``) as far as the text goes. The name and
    the arguments are the first the text has (``args_keys``: any of them), so that what was
    streamed stays true as the text grows."""
    scan = _CallScan()
    i = _skip_ws(text, pos + 1)
    while i < len(text):
        if text[i] == "}":
            scan.end = i + 1
            return scan
        key_end = _string_end(text, i) if text[i] == '"' else None
        if key_end is None:
            return scan
        key = text[i + 1 : key_end - 1]
        i = _skip_ws(text, key_end)
        if i >= len(text) or text[i] != ":":
            return scan
        i = _skip_ws(text, i + 1)
        if i >= len(text):
            return scan
        is_args = key in args_keys and scan.args_start is None
        if is_args:
            scan.args_start = i
        end = _value_end(text, i)
        if end is None:
            return scan
        if is_args:
            scan.args_end = end
        if key == "name" and scan.name is None and text[i] == '"':  # the first, as streamed
            try:
                scan.name = json.loads(text[i:end])
            except ValueError:
                return scan
        i = _skip_ws(text, end)
        if i < len(text) and text[i] == ",":
            i = _skip_ws(text, i + 1)
    return scan


def _arguments(text: str, scan: _CallScan) -> str:
    """The arguments as far as they go: raw JSON text, or a string value once decoded."""
    if scan.args_start is None:
        return "{}" if scan.end is not None else ""
    end = scan.args_end if scan.args_end is not None else len(text)
    raw = text[scan.args_start : end]
    if raw.startswith('"'):
        if scan.args_end is None:
            return ""
        try:
            return str(json.loads(raw))
        except ValueError:
            return ""
    return raw


def _partial(text: str, scan: _CallScan) -> PartialCall:
    return PartialCall(scan.name, _arguments(text, scan), scan.end is not None)


def _finished(text: str, pos: int, args_keys: tuple[str, ...]) -> tuple[ParsedCall, int] | None:
    """The complete, valid call object at ``text[pos]`` and the index past it; else None."""
    decoder = json.JSONDecoder()
    try:
        obj, end = decoder.raw_decode(text, pos)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    scan = _scan_call(text, pos, args_keys)
    return ParsedCall(scan.name or obj["name"], _arguments(text, scan)), end


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
            found = _finished(body, 0, self.ARGS_KEYS) if body.startswith("{") else None
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
            pos = _skip_ws(text, marker + len(self.START))
            if pos >= len(text) or text[pos] != "{":
                break
            scan = _scan_call(text, pos, self.ARGS_KEYS)
            calls.append(_partial(text, scan))
            if scan.end is None:
                break
            marker = text.find(self.START, scan.end)
        return calls


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"
    ARGS_KEYS = ("parameters", "arguments")

    def _body_start(self, text: str) -> int:
        pos = _skip_ws(text, 0)
        if text.startswith(self.TAG, pos):
            pos = _skip_ws(text, pos + len(self.TAG))
        return pos

    @staticmethod
    def _next(text: str, pos: int) -> int:
        while pos < len(text) and text[pos] in _WS + ";":
            pos += 1
        return pos

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.rstrip()
        pos = self._body_start(body)
        if not body.startswith("{", pos):
            return text, []
        calls: list[ParsedCall] = []
        while pos < len(body):
            found = _finished(body, pos, self.ARGS_KEYS)
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
            scan = _scan_call(text, pos, self.ARGS_KEYS)
            calls.append(_partial(text, scan))
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
        pos = _skip_ws(text, 0)
        if not text.startswith("[", pos):
            return text, []
        calls: list[ParsedCall] = []
        pos = _skip_ws(text, pos + 1)
        while text.startswith("{", pos):
            found = _finished(text, pos, self.ARGS_KEYS)
            if found is None:
                return text, []
            calls.append(found[0])
            pos = _skip_ws(text, found[1])
            if text.startswith(",", pos):
                pos = _skip_ws(text, pos + 1)
        if not text.startswith("]", pos) or _skip_ws(text, pos + 1) != len(text):
            return text, []
        return None, calls

    def content_prefix(self, text: str) -> int:
        return 0

    def partial_calls(self, text: str) -> list[PartialCall]:
        calls: list[PartialCall] = []
        pos = _skip_ws(text, 0)
        if not text.startswith("[", pos):
            return calls
        pos = _skip_ws(text, pos + 1)
        while text.startswith("{", pos):
            scan = _scan_call(text, pos, self.ARGS_KEYS)
            calls.append(_partial(text, scan))
            if scan.end is None:
                break
            pos = _skip_ws(text, scan.end)
            if not text.startswith(",", pos):
                break
            pos = _skip_ws(text, pos + 1)
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

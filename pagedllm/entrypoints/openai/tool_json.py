"""Tool calls' JSON read as it grows: where a value ends (or that it has not ended yet), the
name and arguments of a call object as far as the text goes, and the complete calls of an array.

Shared by the ``--tool-call-parser`` formats (``tool_parsers``), the JSON-constrained fallback
(``tool_auto``) and the stop at a repeated call (``tool_repeats``). A call's ``arguments`` are the
JSON text of its arguments value exactly as the model wrote it (a JSON string value is decoded),
so what streams is a prefix of what the finished reply says.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

WS = " \t\r\n"


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
def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in WS:
        pos += 1
    return pos


def string_end(text: str, pos: int) -> int | None:
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


def value_end(text: str, pos: int) -> int | None:
    """Index past the JSON value starting at ``text[pos]``; None while it may go on."""
    first = text[pos]
    if first == '"':
        return string_end(text, pos)
    if first in "{[":
        depth, i = 0, pos
        while i < len(text):
            ch = text[i]
            if ch == '"':
                end = string_end(text, i)
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
    while i < len(text) and text[i] not in ",}]" + WS:
        i += 1
    return i if i < len(text) else None


@dataclass
class CallScan:
    name: str | None = None
    args_start: int | None = None  # first character of the arguments value
    args_end: int | None = None  # past its last, once complete
    end: int | None = None  # past the object's closing brace, once complete


def scan_call(text: str, pos: int, args_keys: tuple[str, ...]) -> CallScan:
    """The call object opening at ``text[pos]`` (``{``) as far as the text goes. The name and
    the arguments are the first the text has (``args_keys``: any of them), so that what was
    streamed stays true as the text grows."""
    scan = CallScan()
    i = skip_ws(text, pos + 1)
    while i < len(text):
        if text[i] == "}":
            scan.end = i + 1
            return scan
        key_end = string_end(text, i) if text[i] == '"' else None
        if key_end is None:
            return scan
        key = text[i + 1 : key_end - 1]
        i = skip_ws(text, key_end)
        if i >= len(text) or text[i] != ":":
            return scan
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return scan
        is_args = key in args_keys and scan.args_start is None
        if is_args:
            scan.args_start = i
        end = value_end(text, i)
        if end is None:
            return scan
        if is_args:
            scan.args_end = end
        if key == "name" and scan.name is None and text[i] == '"':  # the first, as streamed
            try:
                scan.name = json.loads(text[i:end])
            except ValueError:
                return scan
        i = skip_ws(text, end)
        if i < len(text) and text[i] == ",":
            i = skip_ws(text, i + 1)
    return scan


def call_arguments(text: str, scan: CallScan) -> str:
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


def partial_call(text: str, scan: CallScan) -> PartialCall:
    return PartialCall(scan.name, call_arguments(text, scan), scan.end is not None)


def finished_call(text: str, pos: int, args_keys: tuple[str, ...]) -> tuple[ParsedCall, int] | None:
    """The complete, valid call object at ``text[pos]`` and the index past it; else None."""
    decoder = json.JSONDecoder()
    try:
        obj, end = decoder.raw_decode(text, pos)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    scan = scan_call(text, pos, args_keys)
    return ParsedCall(scan.name or obj["name"], call_arguments(text, scan)), end


def array_calls(text: str, pos: int, args_keys: tuple[str, ...]) -> list[tuple[ParsedCall, int]]:
    """The complete call objects of the JSON array opening at ``text[pos]`` (``[``), each with
    the index past it, as far as the text goes (an object with no name string ends the list)."""
    calls: list[tuple[ParsedCall, int]] = []
    pos = skip_ws(text, pos + 1)
    while text.startswith("{", pos):
        scan = scan_call(text, pos, args_keys)
        if scan.end is None or scan.name is None:
            break
        calls.append((ParsedCall(scan.name, call_arguments(text, scan)), scan.end))
        pos = skip_ws(text, scan.end)
        if not text.startswith(",", pos):
            break
        pos = skip_ws(text, pos + 1)
    return calls

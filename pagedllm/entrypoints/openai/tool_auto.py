"""``tool_choice: "auto"`` with no flag: the call format read from the chat template, or a
generic fallback for templates that cannot show tools to the model.

The format is decided once, when the server starts, and logged in one line:

- ``--tool-call-parser`` names it: that parser (a warning if the template ignores ``tools``).
- the template renders ``tools`` (its text with and without a tools list differs) and names a
  known format: ``<tool_call>`` is Hermes/Qwen, ``[TOOL_CALLS]`` Mistral, ``<|python_tag|>`` or a
  ``"parameters"`` object Llama 3 JSON; that parser, the tools rendered by the template.
- otherwise the fallback, as llama.cpp's server does for templates without tool support: the
  tools are described in a system message, and the reply is constrained by a JSON schema to
  either calls, ``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`` (one or more,
  ending at a repeated call; with ``parallel_tool_calls: false``, ``{"tool_call": {...}}``,
  exactly one), or an answer,
  ``{"response": "..."}``; the server turns the first into ``tool_calls``, the second into
  ``content``. With ``response_format`` (``json_object``/``json_schema``, or ``guided_json``)
  the answer's value is that JSON instead of a string, and its text is the content as written.
  Random or weak models still produce well-formed calls or an answer, because the grammar
  leaves them no other way.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.tool_json import (
    ParsedCall,
    PartialCall,
    partial_call,
    scan_call,
    skip_ws,
    string_end,
    value_end,
)
from pagedllm.entrypoints.openai.tool_parsers import RequiredCallsParser, ToolParser

logger = logging.getLogger(__name__)

FALLBACK = "fallback"
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_tool_rendering",
        "description": "probe",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
    },
}
_PROBE_MESSAGES = [{"role": "user", "content": "hello"}]
#: Marker in the template text -> parser, first match wins.
_MARKERS = (
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
    ('"parameters"', "llama3_json"),
)


@dataclass(frozen=True)
class AutoTools:
    """How ``tool_choice: "auto"`` works on this server: a parser's name or ``FALLBACK``."""

    parser: str
    reason: str

    @property
    def fallback(self) -> bool:
        return self.parser == FALLBACK


def renders_tools(render: Callable[..., str]) -> bool:
    """Whether the template shows a tools list at all: its text with one differs from without."""
    try:
        return render(_PROBE_MESSAGES, tools=[_PROBE_TOOL]) != render(_PROBE_MESSAGES)
    except Exception:  # a template that fails on tools cannot show them
        return False


def detect_auto_tools(
    template: str | None, render: Callable[..., str], flag: str | None
) -> AutoTools:
    """The format of "auto" tool calls, and why (see the module docstring); logged once."""
    if flag is not None:
        result = AutoTools(flag, "--tool-call-parser")
        if template and not renders_tools(render):
            logger.warning(
                "tool calls: --tool-call-parser %s, but the chat template does not render "
                "`tools`: the model will not see them (leave the flag out for the fallback)",
                flag,
            )
    elif not template:
        result = AutoTools(FALLBACK, "the model has no chat template")
    elif not renders_tools(render):
        result = AutoTools(FALLBACK, "the chat template does not render `tools`")
    else:
        found = next(((m, p) for m, p in _MARKERS if m in template), None)
        if found is None:
            result = AutoTools(FALLBACK, "the chat template renders tools in no known format")
        else:
            result = AutoTools(found[1], f"the chat template contains {found[0]}")
    how = (
        "JSON-constrained fallback, tools described in a system message"
        if result.fallback
        else f"parser {result.parser}"
    )
    logger.info("tool calls (tool_choice auto): %s (%s)", how, result.reason)
    return result


def fallback_schema(
    schemas: dict[str, dict[str, Any]],
    parallel: bool = True,
    answer: dict[str, Any] | bool | None = None,
) -> dict[str, Any]:
    """The fallback reply: calls of the given tools with their arguments (one or more if
    ``parallel``, else exactly one), or an answer (a string, or JSON of the ``answer`` schema)."""
    calls: dict[str, Any] = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, params in schemas.items()
        ]
    }
    key = "tool_calls" if parallel else "tool_call"
    if parallel:
        calls = {"type": "array", "minItems": 1, "items": calls}
    call = {
        "type": "object",
        "properties": {key: calls},
        "required": [key],
        "additionalProperties": False,
    }
    reply = {
        "type": "object",
        "properties": {"response": answer if answer is not None else {"type": "string"}},
        "required": ["response"],
        "additionalProperties": False,
    }
    return {"anyOf": [call, reply]}


def fallback_prompt(
    tools: list[dict[str, Any]],
    auto: bool,
    parallel: bool = True,
    answer: dict[str, Any] | bool | None = None,
) -> str:
    """The system text that shows the tools to a model whose template cannot (and, for "auto",
    the reply's two shapes: ``fallback_schema``'s)."""
    lines = ["You can call these tools:"]
    for tool in tools:
        fn = tool["function"]
        desc = f": {fn['description']}" if fn.get("description") else ""
        params = json.dumps(fn.get("parameters", {"type": "object"}))
        lines.append(f"- {fn['name']}{desc}. Arguments (JSON schema): {params}")
    if auto:
        one = '{"name": <tool name>, "arguments": {...}}'
        if parallel:
            lines.append(f'To call tools, reply {{"tool_calls": [{one}, ...]}} (one or more).')
        else:
            lines.append(f'To call a tool, reply {{"tool_call": {one}}}.')
        if answer is None:
            lines.append('Otherwise reply {"response": <your answer>}.')
        else:
            lines.append(
                'Otherwise reply {"response": <your answer as JSON>}, the answer following this '
                f"JSON schema: {json.dumps(answer)}"
            )
        lines.append("Call a tool when one can help.")
    return "\n".join(lines)


def with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """``text`` merged into the first system message, or a system message put first."""
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{text}\n\n{first.get('content') or ''}".rstrip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _partial_string(text: str, pos: int) -> str:
    """The JSON string opening at ``text[pos]`` decoded as far as it certainly goes."""
    end = string_end(text, pos)
    if end is not None:
        return str(json.loads(text[pos:end]))
    cut = len(text)
    while cut > pos + 1:  # drop an unfinished escape at the end
        try:
            return str(json.loads(text[pos:cut] + '"'))
        except ValueError:
            cut -= 1
    return ""


class FallbackToolParser(ToolParser):
    """The fallback's reply: ``{"tool_calls": [...]}``, ``{"tool_call": {...}}`` or
    ``{"response": ...}``; ``raw_answer``: the response is JSON whose text is the content (a
    ``response_format`` answer), not a string to decode."""

    name = FALLBACK
    ARGS_KEYS = ("arguments",)

    def __init__(self, raw_answer: bool = False) -> None:
        self.raw_answer = raw_answer

    @staticmethod
    def _branch(text: str) -> tuple[str | None, int]:
        """The reply's one key, once complete, and the start of its value (or -1)."""
        pos = skip_ws(text, 0)
        if not text.startswith("{", pos):
            return None, -1
        pos = skip_ws(text, pos + 1)
        end = string_end(text, pos) if text.startswith('"', pos) else None
        if end is None:
            return None, -1
        key = text[pos + 1 : end - 1]
        pos = skip_ws(text, end)
        if not text.startswith(":", pos):
            return key, -1
        pos = skip_ws(text, pos + 1)
        return key, (pos if pos < len(text) else -1)

    def _answer(self, text: str, pos: int) -> str:
        """The ``response`` value as content, as far as the text goes."""
        if not self.raw_answer:
            return _partial_string(text, pos) if text.startswith('"', pos) else ""
        end = value_end(text, pos)
        return text[pos : len(text) if end is None else end]

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        try:
            reply = json.loads(text)
        except ValueError:
            return text, []
        key, pos = self._branch(text)
        if not isinstance(reply, dict) or key not in reply or pos < 0:
            return text, []
        if key == "response":
            if self.raw_answer or isinstance(reply[key], str):
                return self._answer(text, pos), []
            return text, []
        if key == "tool_calls" and isinstance(reply[key], list):
            end = value_end(text, pos)
            calls = RequiredCallsParser().parse(text[pos:end])[1] if end else []
            return (None, calls) if calls and len(calls) == len(reply[key]) else (text, [])
        call = reply.get("tool_call")
        if (
            key != "tool_call"
            or not isinstance(call, dict)
            or not isinstance(call.get("name"), str)
        ):
            return text, []
        partial = self.partial_calls(text)
        if len(partial) != 1 or not partial[0].done:
            return text, []
        return None, [ParsedCall(call["name"], partial[0].arguments)]

    def content_prefix(self, text: str) -> int:
        return 0  # the reply is JSON; its content is streamed by ``streamed_content``

    def calls_array(self, text: str) -> tuple[int, str] | None:
        key, pos = self._branch(text)
        if key == "tool_calls" and pos >= 0 and text.startswith("[", pos):
            return pos, "]}"
        return None

    def streamed_content(self, text: str, finished: bool) -> str:
        """The ``response`` value as far as it goes; none of the JSON around it, also when the
        reply is cut before the value begins (all of the text if it is not this JSON at all)."""
        key, pos = self._branch(text)
        if key == "response":
            return self._answer(text, pos) if pos >= 0 else ""
        if finished and not text.lstrip().startswith("{"):
            return text
        return ""

    def partial_calls(self, text: str) -> list[PartialCall]:
        key, pos = self._branch(text)
        if key == "tool_calls" and pos >= 0:
            return RequiredCallsParser().partial_calls(text[pos:])
        if key != "tool_call" or pos < 0 or not text.startswith("{", pos):
            return []
        return [partial_call(text, scan_call(text, pos, self.ARGS_KEYS))]

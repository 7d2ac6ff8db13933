"""Tool calling on /v1/chat/completions: checking tools, constraining or parsing calls, replies.

``tool_choice`` decides how calls are produced:
- ``"none"``: tools are not shown to the model; a plain reply.
- ``"auto"`` (the default with tools): tools are rendered by the chat template and the reply is
  parsed in the format the template names (or ``--tool-call-parser``); a template that cannot
  render tools gets the JSON-constrained fallback of ``tool_auto`` (the tools described in a
  system message, the reply calls (one or more; exactly one with ``parallel_tool_calls:
  false``) or an answer, the answer shaped by ``response_format``).
- ``"required"``: constrained decoding to a JSON array of ``{"name", "arguments"}`` objects, one
  schema per tool (``parallel_tool_calls: false`` allows one call).

A constrained list of calls (``"required"``, the fallback's) ends at its first repeated call:
``tool_repeats``.
- a named function: constrained decoding to that function's ``parameters`` schema; the whole reply
  is its arguments.

Streamed, every call's arguments go out as they are generated, in OpenAI's (and vLLM's) shape: the
first delta of a call carries its ``index``, ``id``, ``type`` and ``function.name`` (with the
arguments so far, possibly ``""``), later ones only ``index`` and ``function.arguments``.
A reply cut short (``max_tokens``) keeps that shape unstreamed too: the calls begun, with their
arguments so far, and the finish reason ``length``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.guided_params import GuidedDecodingParams
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.serving_structured import guided_from_request
from pagedllm.entrypoints.openai.tool_auto import (
    AutoTools,
    FallbackToolParser,
    fallback_prompt,
    fallback_schema,
)
from pagedllm.entrypoints.openai.tool_parsers import (
    ParsedCall,
    PartialCall,
    RequiredCallsParser,
    ToolParser,
    get_tool_parser,
)
from pagedllm.outputs import CompletionOutput

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _bad(param: str, message: str) -> APIError:
    return APIError(f"{param}: {message}", param=param)


@dataclass
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]] | None = None  # what the chat template renders
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> parameters
    named: str | None = None
    guided: GuidedDecodingParams | None = None
    parser: ToolParser | None = None  # "auto": the server's format; "required": the JSON array
    system_text: str | None = None  # the fallback: the tools described for the model
    # The fallback: the request's own JSON constraint (its parameter), now its answer's schema.
    answer_param: str | None = None

    @property
    def active(self) -> bool:
        return self.mode != "none"


def check_tools(tools: Any) -> dict[str, dict[str, Any]]:
    """``tools`` in OpenAI's shape; returns name -> parameters schema (400 naming ``tools``)."""
    if not isinstance(tools, list) or not tools:
        raise _bad("tools", "must be a non-empty list")
    schemas: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _bad("tools", f"{where}: only tools of type 'function' are supported")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad("tools", f"{where}.function: must be an object with a 'name'")
        name = fn["name"]
        if not _NAME.match(name):
            raise _bad("tools", f"{where}.function.name: must be 1-64 of a-z, A-Z, 0-9, _ and -")
        if name in schemas:
            raise _bad("tools", f"{where}.function.name: {name!r} appears twice")
        params = fn.get("parameters", _ANY_OBJECT)
        if not isinstance(params, dict):
            raise _bad("tools", f"{where}.function.parameters: must be a JSON schema object")
        schemas[name] = params
    return schemas


def _required_schema(schemas: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, params in schemas.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def plan_tools(req: ChatCompletionRequest, auto: AutoTools) -> ToolPlan:
    """What the request's tools and tool_choice ask for, checked (400 naming the parameter);
    ``auto`` is the server's format for "auto" calls (a parser, or the fallback)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise _bad("tool_choice", "requires tools")
        return ToolPlan("none")
    schemas = check_tools(req.tools)
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan("none")
    plan = ToolPlan("auto", tools=list(req.tools), schemas=schemas)
    if choice == "auto" and auto.fallback:
        return _fallback_plan(req, plan)
    if auto.fallback:  # the template cannot show the tools: a system message does
        plan.tools, plan.system_text = None, fallback_prompt(req.tools, False)
    if choice == "auto":
        plan.parser = get_tool_parser(auto.parser)
        return plan
    if choice == "required":
        plan.mode, plan.parser = "required", RequiredCallsParser()
        plan.guided = GuidedDecodingParams(
            json=_required_schema(schemas, req.parallel_tool_calls is not False)
        )
    elif isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in schemas:
            raise _bad("tool_choice", f"no tool named {name!r}; tools are {sorted(schemas)}")
        plan.mode, plan.named = "named", name
        plan.guided = GuidedDecodingParams(json=schemas[name])
    else:
        raise _bad(
            "tool_choice",
            "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
        )
    return plan


def _answer_schema(guided: GuidedDecodingParams | None, param: str | None) -> Any:
    """The fallback's answer under the request's own constraint: a JSON one becomes the schema
    of the ``response`` value; others cannot be put inside the reply's JSON (400)."""
    if guided is None:
        return None  # a plain string
    if guided.json_object:
        return dict(_ANY_OBJECT)
    if guided.json is not None:
        return guided.json  # a schema object, or true / false
    raise _bad(
        str(param),
        "cannot be combined with tool_choice 'auto' here: the chat template cannot render tools, "
        "so the reply is JSON (a call or an answer); response_format json_object/json_schema or "
        "guided_json can shape the answer",
    )


def _fallback_plan(req: ChatCompletionRequest, plan: ToolPlan) -> ToolPlan:
    """The "auto" choice on a template without tools: the tools in a system message, the reply
    constrained to calls or an answer (the request's ``response_format`` shaping it).

    One or more calls per reply, as OpenAI's ``parallel_tool_calls`` defaults to; false: exactly
    one. Small models, free to add calls, repeat one (the demo model did until max_tokens in 3
    replies of 8): the reply ends at the first repeat (``tool_repeats``).
    """
    assert req.tools is not None
    guided, param = guided_from_request(req)
    answer = _answer_schema(guided, param)
    parallel = req.parallel_tool_calls is not False
    plan.tools = None
    plan.system_text = fallback_prompt(req.tools, True, parallel, answer)
    plan.parser = FallbackToolParser(raw_answer=answer is not None)
    plan.guided = GuidedDecodingParams(json=fallback_schema(plan.schemas, parallel, answer))
    plan.answer_param = param
    return plan


def history_message(
    item: dict[str, Any], tool_calls: list[dict[str, Any]] | None, tool_call_id: str | None
) -> dict[str, Any]:
    """Tool-calling history as chat templates expect it: arguments as objects, ids kept."""
    if tool_calls:
        calls = []
        for call in tool_calls:
            fn = dict(call.get("function") or {})
            args = fn.get("arguments")
            if isinstance(args, str):
                with contextlib.suppress(ValueError):
                    fn["arguments"] = json.loads(args)
            calls.append({**call, "function": fn})
        item["tool_calls"] = calls
    if tool_call_id is not None:
        item["tool_call_id"] = tool_call_id
    return item


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _calls_of(plan: ToolPlan, text: str) -> tuple[str | None, list[ParsedCall]]:
    if plan.mode == "named":
        assert plan.named is not None
        return None, [ParsedCall(plan.named, text)]
    assert plan.parser is not None
    return plan.parser.parse(text)


def _content(parser: ToolParser, text: str, finished: bool, calls_begun: bool) -> str:
    """The content of ``text`` as a stream sends it: the parser's, or the text up to its
    ``content_prefix`` (all of it once finished with no call begun, unless the reply is
    constrained JSON: "required" cut before a call's name is complete says nothing)."""
    content = parser.streamed_content(text, finished)
    if content is not None:
        return content
    if finished and not calls_begun and parser.TEXT_IS_CONTENT:
        return text
    return text[: parser.content_prefix(text)]


def _cut_message(plan: ToolPlan, c: CompletionOutput) -> dict[str, Any]:
    """A reply cut short, as its stream ends: the calls begun with their arguments so far."""
    if plan.mode == "named":
        assert plan.named is not None
        calls = [PartialCall(plan.named, c.text, False)]
        content = None
    else:
        assert plan.parser is not None
        calls = []
        for call in plan.parser.partial_calls(c.text):
            if call.name is None:
                break
            calls.append(call)
        content = _content(plan.parser, c.text, True, bool(calls))
        if not content and (calls or not plan.parser.TEXT_IS_CONTENT):
            content = None
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [_call_dict(call.name or "", call.arguments) for call in calls]
    return message


def _call_dict(name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_message(plan: ToolPlan, c: CompletionOutput) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a finished choice, and its finish_reason."""
    if c.finish_reason != "stop":  # cut short: what was begun, as the stream would end it
        return _cut_message(plan, c), c.finish_reason
    content, calls = _calls_of(plan, c.text)
    if not calls:
        return {"role": "assistant", "content": content}, c.finish_reason
    tool_calls = [_call_dict(call.name, call.arguments) for call in calls]
    return {"role": "assistant", "content": content, "tool_calls": tool_calls}, "tool_calls"


class ToolStreamer:
    """Per choice: turns growing outputs into chat deltas, tool calls in OpenAI's stream shape.

    Content goes out as far as the parser says it is certainly content; each call goes out once
    its name is complete, then its arguments as they grow. At the end the finished reply is
    parsed as it is unstreamed, and what it says beyond what was sent closes the stream, so the
    deltas add up to the unstreamed reply's calls. A call that began streaming in a reply that
    then does not parse (cut short, or malformed) ends as it was sent.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._sent = 0  # characters of text already sent (content, or a named call's arguments)
        self._args_sent: list[str] = []  # per call begun: the arguments sent so far
        self._started = False

    def delta(self, c: CompletionOutput) -> tuple[dict[str, Any] | None, str | None]:
        """The delta for this output (None if nothing new) and the finish_reason to report."""
        if self.plan.mode == "named":
            return self._named(c)
        assert self.plan.parser is not None
        parser, text = self.plan.parser, c.text
        delta: dict[str, Any] = {}
        if c.finish_reason is None:
            # A constrained list of calls ends at a repeat (tool_repeats): a call to a tool
            # already called waits until it is complete, so that no repeat is ever sent.
            calls = self._advance(parser.partial_calls(text), parser.calls_array(text) is not None)
            reason = None
        else:
            calls, reason = self._finish(c)
        finished = c.finish_reason is not None
        content = _content(parser, text, finished, bool(self._args_sent))
        if len(content) > self._sent:
            delta["content"], self._sent = content[self._sent :], len(content)
        if calls:
            delta["tool_calls"] = calls
        return (delta or None), reason

    def _advance(
        self, calls: list[PartialCall], hold_repeats: bool = False
    ) -> list[dict[str, Any]]:
        """Deltas for the calls begun so far: a new call's head, new argument text; with
        ``hold_repeats``, none yet for an unfinished call to a tool already called."""
        out: list[dict[str, Any]] = []
        for i, call in enumerate(calls):
            if call.name is None:
                break
            held = hold_repeats and i >= len(self._args_sent) and not call.done
            if held and any(earlier.name == call.name for earlier in calls[:i]):
                break
            if i == len(self._args_sent):
                self._args_sent.append(call.arguments)
                fn = {"name": call.name, "arguments": call.arguments}
                out.append({"index": i, "id": call_id(), "type": "function", "function": fn})
                continue
            sent = self._args_sent[i]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                out.append({"index": i, "function": {"arguments": call.arguments[len(sent) :]}})
                self._args_sent[i] = call.arguments
        return out

    def _finish(self, c: CompletionOutput) -> tuple[list[dict[str, Any]], str | None]:
        """The last tool-call deltas and the finish reason, from the reply as unstreamed."""
        assert self.plan.parser is not None
        parsed = self.plan.parser.parse(c.text)[1] if c.finish_reason == "stop" else []
        if not parsed:  # cut short or malformed: what began streaming ends as it is
            return self._advance(self.plan.parser.partial_calls(c.text)), c.finish_reason
        done = [PartialCall(call.name, call.arguments, True) for call in parsed]
        for i, (sent, call) in enumerate(zip(self._args_sent, parsed, strict=False)):
            if not call.arguments.startswith(sent):
                logger.warning("tool call %d: streamed arguments differ from the reply's", i)
                done[i] = PartialCall(call.name, sent, True)
        return self._advance(done), "tool_calls"

    def _named(self, c: CompletionOutput) -> tuple[dict[str, Any] | None, str | None]:
        reason = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
        call: dict[str, Any] = {"index": 0}
        if not self._started:
            self._started = True
            call.update(id=call_id(), type="function", function={"name": self.plan.named})
            call["function"]["arguments"] = ""
        piece, self._sent = c.text[self._sent :], len(c.text)
        if piece:
            call.setdefault("function", {})["arguments"] = piece
        if len(call) == 1 and reason is None:
            return None, None
        return ({"tool_calls": [call]} if len(call) > 1 else {}), reason

"""Tool-call parsers and the streaming of tool calls, on hand-written replies."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.serving_tools import ToolPlan, ToolStreamer, tool_message
from pagedllm.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    ParsedCall,
    get_tool_parser,
)
from pagedllm.outputs import CompletionOutput

HERMES = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
)


def test_hermes_parses_prose_and_several_calls() -> None:
    content, calls = HermesToolParser().parse(HERMES)
    assert content == "Let me check."
    assert calls == [
        ParsedCall("get_weather", '{"city": "Oslo"}'),
        ParsedCall("add", '{"a": 1, "b": 2}'),
    ]
    assert HermesToolParser().parse("just text") == ("just text", [])
    # A broken call leaves the whole reply as text.
    broken = "<tool_call>{not json}</tool_call>"
    assert HermesToolParser().parse(broken) == (broken, [])


def test_hermes_holds_back_what_may_start_a_call() -> None:
    p = HermesToolParser()
    assert p.content_prefix("Hello <tool") == len("Hello ")
    assert p.content_prefix("Hello <b>") == len("Hello <b>")
    assert p.content_prefix("Hi <tool_call>{") == len("Hi ")


def test_llama3_json() -> None:
    p = Llama3JsonToolParser()
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "f", "arguments": {}}'
    assert p.parse(text) == (None, [ParsedCall("add", '{"a": 1}'), ParsedCall("f", "{}")])
    assert p.parse("The answer is 4.") == ("The answer is 4.", [])
    assert p.parse('{"no_name": 1}') == ('{"no_name": 1}', [])
    assert p.content_prefix("  {") == 0 and p.content_prefix("The") == 3
    with pytest.raises(ValueError, match="^tool_call_parser"):
        get_tool_parser("mistral")


def out(text: str, reason: str | None) -> CompletionOutput:
    return CompletionOutput(
        index=0,
        text=text,
        token_ids=[0] * len(text),
        cumulative_logprob=0.0,
        logprobs=None,
        finish_reason=reason,
    )


def test_auto_stream_sends_content_then_whole_calls() -> None:
    plan = ToolPlan("auto", parser=HermesToolParser())
    streamer = ToolStreamer(plan)
    pieces, calls, reason = "", [], None
    for end in range(1, len(HERMES) + 1):
        delta, r = streamer.delta(out(HERMES[:end], "stop" if end == len(HERMES) else None))
        if delta:
            pieces += delta.get("content", "")
            calls += delta.get("tool_calls", [])
        reason = r or reason
    assert pieces == "Let me check. "
    assert reason == "tool_calls"
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather"), (1, "add")]
    assert json.loads(calls[1]["function"]["arguments"]) == {"a": 1, "b": 2}
    message, final = tool_message(plan, out(HERMES, "stop"))
    assert final == "tool_calls" and message["content"] == "Let me check."


def test_named_stream_sends_arguments_as_they_come() -> None:
    streamer = ToolStreamer(ToolPlan("named", named="add"))
    first, _ = streamer.delta(out('{"a"', None))
    assert first is not None
    call = first["tool_calls"][0]
    assert call["id"].startswith("call_") and call["function"] == {
        "name": "add",
        "arguments": '{"a"',
    }
    second, reason = streamer.delta(out('{"a": 1}', "stop"))
    assert second == {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}
    assert reason == "tool_calls"
    # Cut short by max_tokens: no tool_calls finish reason.
    message, final = tool_message(ToolPlan("named", named="add"), out('{"a": 1', "length"))
    assert final == "length" and "tool_calls" not in message

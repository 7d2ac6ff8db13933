"""Tool-call parsers and the streaming of tool calls, on hand-written replies grown one character
at a time."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pagedllm.entrypoints.openai.serving_tools import ToolPlan, ToolStreamer, tool_message
from pagedllm.entrypoints.openai.tool_auto import FallbackToolParser
from pagedllm.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ParsedCall,
    PartialCall,
    RequiredCallsParser,
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
        get_tool_parser("nonsense")


def out(text: str, reason: str | None) -> CompletionOutput:
    return CompletionOutput(
        index=0,
        text=text,
        token_ids=[0] * len(text),
        cumulative_logprob=0.0,
        logprobs=None,
        finish_reason=reason,
    )


def stream(plan: ToolPlan, text: str, reason: str = "stop") -> tuple[str, list[dict], str | None]:
    """Feed ``text`` one character at a time, as a model would grow it; returns the content
    sent, the calls put together from their deltas (each with its argument deltas) and the
    finish reason. Every delta is checked against OpenAI's stream shape on the way."""
    streamer = ToolStreamer(plan)
    content, calls, final = "", [], None
    for end in range(1, len(text) + 1):
        delta, r = streamer.delta(out(text[:end], reason if end == len(text) else None))
        final = r or final
        content += (delta or {}).get("content", "")
        for tc in (delta or {}).get("tool_calls", []):
            if tc["index"] == len(calls):  # a call's first delta: id, type, name
                assert tc["id"].startswith("call_") and tc["type"] == "function", tc
                assert set(tc["function"]) == {"name", "arguments"}, tc
                calls.append({**tc["function"], "pieces": [tc["function"]["arguments"]]})
            else:  # later deltas: the index and an arguments fragment only
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
                calls[tc["index"]]["pieces"].append(tc["function"]["arguments"])
    return content, calls, final


def unstreamed(plan: ToolPlan, text: str) -> list[tuple[str, str]]:
    message, reason = tool_message(plan, out(text, "stop"))
    assert reason == "tool_calls", message
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


LLAMA3 = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": [2, 3]}}; {"name": "f"}'
REQUIRED = (
    '[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}, '
    '{"name": "add", "arguments": {"a": 12, "b": 30}}]'
)


@pytest.mark.parametrize(
    ("plan", "text", "content"),
    [
        (ToolPlan("auto", parser=HermesToolParser()), HERMES, "Let me check. "),
        (ToolPlan("auto", parser=Llama3JsonToolParser()), LLAMA3, ""),
        (ToolPlan("required", parser=RequiredCallsParser()), REQUIRED, ""),
    ],
    ids=["hermes", "llama3_json", "required"],
)
def test_streamed_calls_send_arguments_as_they_are_generated(
    plan: ToolPlan, text: str, content: str
) -> None:
    sent, calls, reason = stream(plan, text)
    assert sent == content and reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == unstreamed(plan, text)
    for call in calls:
        if call["arguments"] != "{}":  # a call without arguments has nothing to stream
            assert len([p for p in call["pieces"] if p]) > 1, call
        assert call["pieces"][0] == "", call  # the name went out before any argument


def test_arguments_are_the_text_the_model_wrote() -> None:
    """Not re-serialised: a stream of the raw text adds up to exactly the unstreamed value."""
    text = '<tool_call>{"name": "add", "arguments": {"a":1,  "b" :2}}</tool_call>'
    assert HermesToolParser().parse(text) == (None, [ParsedCall("add", '{"a":1,  "b" :2}')])
    # Arguments given as a JSON string are that string, sent whole once it is closed.
    text = '{"name": "add", "parameters": "{\\"a\\": 1}"}'
    _, calls, _ = stream(ToolPlan("auto", parser=Llama3JsonToolParser()), text)
    assert [(c["name"], c["pieces"]) for c in calls] == [("add", ["", '{"a": 1}'])]


def test_a_reply_cut_short_ends_its_call_as_sent() -> None:
    plan = ToolPlan("auto", parser=HermesToolParser())
    text = 'Hi <tool_call>{"name": "add", "arguments": {"a": 1'
    content, calls, reason = stream(plan, text, reason="length")
    assert (content, reason) == ("Hi ", "length")
    assert [(c["name"], c["arguments"]) for c in calls] == [("add", '{"a": 1')]
    # No call begun: the held-back text is content after all, as unstreamed.
    content, calls, reason = stream(plan, "Hi <tool_", reason="length")
    assert (content, calls, reason) == ("Hi <tool_", [], "length")
    content, calls, reason = stream(plan, "<tool_call>{not json}</tool_call>")
    assert (content, calls, reason) == ("<tool_call>{not json}</tool_call>", [], "stop")


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
    # Cut short by max_tokens: the call as far as it went, the finish reason "length".
    message, final = tool_message(ToolPlan("named", named="add"), out('{"a": 1', "length"))
    assert final == "length" and message["content"] is None
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "add", "arguments": '{"a": 1'}
    ]


FRAGMENTS = ["{", "}", "[", "]", '"', ":", ",", ";", " ", "\\", "a", "1", "<tool_call>"]
FRAGMENTS += [
    '"tool_call"',
    '"response"',
    "[TOOL_CALLS]",
    '"f"',
    "</tool_call>",
    '"name"',
    '"add"',
    '"arguments"',
    '"parameters"',
    "<|python_tag|>",
    '"tool_calls"',
    '"response"',
]


PARSERS = [
    HermesToolParser(),
    Llama3JsonToolParser(),
    RequiredCallsParser(),
    MistralToolParser(),
    FallbackToolParser(),
    FallbackToolParser(raw_answer=True),
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=40))
@example(["{", '"name"', ":", '"add"', ",", '"name"', ":", '"f"', "}"])  # the first name stays
def test_any_text_parses_and_partial_arguments_only_grow(fragments: list[str]) -> None:
    """On any text no parser raises, and as the text grows each begun call keeps its name and
    its arguments only grow (what streamed is never taken back)."""
    text = "".join(fragments)
    for parser in PARSERS:
        parser.parse(text)
        assert 0 <= parser.content_prefix(text) <= len(text)
        whole = parser.partial_calls(text)
        for end in range(len(text)):
            for i, call in enumerate(parser.partial_calls(text[:end])):
                if call.name is not None:
                    assert whole[i].name == call.name, (parser.name, text[:end])
                    assert whole[i].arguments.startswith(call.arguments), (parser.name, text[:end])


MISTRAL = 'Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}]'
FALLBACK_CALL = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo"}}}'
FALLBACK_TEXT = '{"response": "It is \\"sunny\\" \\u00e9t\\u00e9"}'
FALLBACK_CALLS = (
    '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
    '{"name": "add", "arguments": {"a": 1, "b": [2, "}"]}}]}'
)
FALLBACK_JSON = '{"response": {"name": "ann", "tags": ["}", "]"], "age": 3}}'


def test_mistral_and_the_fallback_parse() -> None:
    assert MistralToolParser().parse(MISTRAL) == ("Sure.", [ParsedCall("add", '{"a": 1, "b": 2}')])
    assert MistralToolParser().content_prefix("Hi [TOOL") == 3
    p = FallbackToolParser()
    assert p.parse(FALLBACK_CALL) == (None, [ParsedCall("get_weather", '{"city": "Oslo"}')])
    assert p.parse(FALLBACK_TEXT) == ('It is "sunny" été', [])
    assert p.parse("not json") == ("not json", [])


def test_the_fallback_parses_several_calls_and_a_json_answer() -> None:
    assert FallbackToolParser().parse(FALLBACK_CALLS) == (
        None,
        [
            ParsedCall("get_weather", '{"city": "Oslo"}'),
            ParsedCall("add", '{"a": 1, "b": [2, "}"]}'),
        ],
    )
    cut = FALLBACK_CALLS[: FALLBACK_CALLS.index('"b"')]  # calls stream as they are written
    assert FallbackToolParser().partial_calls(cut) == [
        PartialCall("get_weather", '{"city": "Oslo"}', True),
        PartialCall("add", '{"a": 1, ', False),
    ]
    raw = FallbackToolParser(raw_answer=True)
    answer = '{"name": "ann", "tags": ["}", "]"], "age": 3}'
    assert raw.parse(FALLBACK_JSON) == (answer, [])
    assert raw.parse('{"response": "a string"}') == ('"a string"', [])  # JSON text, as written
    # Cut before the answer's value begins: none of the wrapping JSON is content.
    assert raw.streamed_content('{"response": ', True) == ""
    assert FallbackToolParser().streamed_content('{"resp', True) == ""


@pytest.mark.parametrize(
    ("plan", "text", "content", "reason"),
    [
        (ToolPlan("auto", parser=MistralToolParser()), MISTRAL, "Sure. ", "tool_calls"),
        (ToolPlan("auto", parser=FallbackToolParser()), FALLBACK_CALL, "", "tool_calls"),
        (ToolPlan("auto", parser=FallbackToolParser()), FALLBACK_TEXT, 'It is "sunny" été', "stop"),
        (ToolPlan("auto", parser=FallbackToolParser()), FALLBACK_CALLS, "", "tool_calls"),
        (
            ToolPlan("auto", parser=FallbackToolParser(raw_answer=True)),
            FALLBACK_JSON,
            FALLBACK_JSON[len('{"response": ') : -1],
            "stop",
        ),
    ],
    ids=["mistral", "fallback-call", "fallback-text", "fallback-calls", "fallback-json"],
)
def test_streamed_equals_unstreamed(plan: ToolPlan, text: str, content: str, reason: str) -> None:
    sent, calls, final = stream(plan, text)
    assert (sent, final) == (content, reason)
    message, unstreamed_reason = tool_message(plan, out(text, "stop"))
    assert unstreamed_reason == reason
    got = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])
    ]
    assert [(c["name"], c["arguments"]) for c in calls] == got


@pytest.mark.parametrize(
    "plan",
    [
        ToolPlan("auto", parser=HermesToolParser()),
        ToolPlan("auto", parser=Llama3JsonToolParser()),
        ToolPlan("auto", parser=MistralToolParser()),
        ToolPlan("auto", parser=FallbackToolParser()),
        ToolPlan("auto", parser=FallbackToolParser(raw_answer=True)),
        ToolPlan("required", parser=RequiredCallsParser()),
        ToolPlan("named", named="add"),
    ],
    ids=["hermes", "llama3_json", "mistral", "fallback", "fallback-json", "required", "named"],
)
@pytest.mark.parametrize(
    "text",
    [
        HERMES,
        LLAMA3,
        REQUIRED,
        MISTRAL,
        FALLBACK_CALL,
        FALLBACK_TEXT,
        FALLBACK_CALLS,
        FALLBACK_JSON,
    ],
)
def test_a_reply_cut_anywhere_has_the_same_shape_streamed_and_not(
    plan: ToolPlan, text: str
) -> None:
    """Cut by max_tokens at every length: the stream's content and calls are the unstreamed
    message's, and both finish with "length"."""
    for end in range(1, len(text) + 1):
        cut = text[:end]
        sent, calls, reason = stream(plan, cut, reason="length")
        message, final = tool_message(plan, out(cut, "length"))
        assert reason == final == "length"
        assert (message["content"] or "") == sent, (cut, message)
        got = [
            (c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls", [])
        ]
        assert [(c["name"], c["arguments"]) for c in calls] == got, cut


def _jinja(template: str):  # type: ignore[no-untyped-def]
    import jinja2

    compiled = jinja2.Environment().from_string(template)
    return lambda messages, tools=None, **kw: compiled.render(messages=messages, tools=tools)


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "fallback"),
        ("{% if tools %}<tool_call>{% endif %}{{ messages[0].content }}", "hermes"),
        ("{% if tools %}[TOOL_CALLS]{% endif %}{{ messages[0].content }}", "mistral"),
        ("{% if tools %}<|python_tag|>{% endif %}{{ messages[0].content }}", "llama3_json"),
        ("{% if tools %}{{ tools | tojson }}{% endif %}{{ messages[0].content }}", "fallback"),
        # Names a format but never renders the tools: the model would not see them.
        ("<tool_call>{{ messages[0].content }}", "fallback"),
    ],
)
def test_the_format_is_read_from_the_template(
    template: str, parser: str, caplog: pytest.LogCaptureFixture
) -> None:
    from pagedllm.entrypoints.openai.tool_auto import detect_auto_tools

    with caplog.at_level("INFO"):
        assert detect_auto_tools(template, _jinja(template), None).parser == parser
    assert len(caplog.records) == 1 and parser in caplog.records[0].getMessage()
    assert detect_auto_tools(template, _jinja(template), "llama3_json").parser == "llama3_json"

"""``tool_choice`` left out (OpenAI's "auto") with no server flag, with the official client.

Two servers on the tiny random Llama of ``test_structured_server``: one whose chat template
renders tools in the Hermes format (the parser is read from it), one whose template has no tools
branch (the JSON-constrained fallback). Random weights write nonsense, so what is asserted is
what the format or the constraint guarantees: a call's name is a tool's and its arguments
validate; streamed and unstreamed replies agree, also when cut by ``max_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.entrypoints import test_structured_server as structured
from tests.entrypoints.conftest import API_KEY, ServerHandle, start_server
from tests.entrypoints.test_structured_server import (
    AUTO_CALLS,
    MODEL,
    SCHEMAS,
    TOOLS,
    collect_tool_calls,
)

tools_model = structured.tools_model  # the fixture: the tiny Llama with a tools template

PLAIN_TEMPLATE = (  # ChatML without a tools branch
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER_TOOL = [TOOLS[0]]
PARIS = [{"role": "user", "content": "What's the weather in Paris?"}]


def _serve(model: Path, chat_template: str | None) -> Iterator[ServerHandle]:
    from pagedllm.engine.async_engine import AsyncEngine
    from pagedllm.entrypoints.openai.api_server import ServerSettings, build_app, model_info

    engine = AsyncEngine.from_engine_args(
        str(model),
        "cpu",
        dtype="float32",
        num_kv_blocks=1024,
        block_size=8,
        max_model_len=2048,
        max_num_seqs=16,
        log_stats_interval=None,
    )
    settings = ServerSettings(api_key=API_KEY, chat_template=chat_template)
    app = build_app(engine, model_info(engine, [MODEL]), settings)
    srv, thread, port = start_server(app)
    yield ServerHandle(f"http://127.0.0.1:{port}", engine, srv, thread)
    srv.should_exit = True
    thread.join(30)


def _client(server: ServerHandle) -> Any:
    import openai

    return openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def native(tools_model: Path) -> Iterator[Any]:
    for server in _serve(tools_model, None):
        yield _client(server)


@pytest.fixture(scope="module")
def fallback(tools_model: Path) -> Iterator[Any]:
    for server in _serve(tools_model, PLAIN_TEMPLATE):
        yield _client(server)


def _shape(message: Any, reason: str | None) -> tuple[Any, ...]:
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    return message.content or "", calls, reason


def _streamed_shape(stream: Any) -> tuple[Any, ...]:
    chunks = list(stream)
    content = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
    reasons = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
    calls = [(c["name"], c["arguments"]) for c in collect_tool_calls(chunks)]
    assert len(reasons) == 1, reasons
    return content, calls, reasons[0]


def test_the_native_template_chooses_its_parser(native: Any, caplog: Any) -> None:
    """No flag: the template says <tool_call>, so "auto" parses Hermes calls (the regex stands
    in for a trained model writing its template's format)."""
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        messages=PARIS,
        tools=WEATHER_TOOL,
        seed=11,
        max_tokens=200,
        extra_body={"guided_regex": AUTO_CALLS["hermes"][0]},
    )
    r = native.chat.completions.create(**kwargs)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
    streamed = _streamed_shape(native.chat.completions.create(stream=True, **kwargs))
    assert streamed[1:] == _shape(r.choices[0].message, "tool_calls")[1:]


def test_the_fallback_answers_with_a_call_or_text(fallback: Any) -> None:
    """A template without tools: the reply is a get_weather call with valid arguments or a
    text answer, the same streamed; over a few seeds the random model makes a call."""
    made_calls = 0
    for seed in range(6):
        kwargs: dict[str, Any] = dict(
            model=MODEL, messages=PARIS, tools=WEATHER_TOOL, seed=seed, max_tokens=300
        )
        r = fallback.chat.completions.create(**kwargs)
        choice = r.choices[0]
        shape = _shape(choice.message, choice.finish_reason)
        if choice.finish_reason == "tool_calls":
            assert choice.message.tool_calls and choice.message.content is None
            for call in choice.message.tool_calls:  # one or more (parallel calls by default)
                assert call.function.name == "get_weather"
                jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
            made_calls += 1
        else:
            # A text answer (random weights write long ones: cut by max_tokens).
            assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
            assert isinstance(choice.message.content, str)
            assert not choice.message.content.startswith('{"response"')
        assert _streamed_shape(fallback.chat.completions.create(stream=True, **kwargs)) == shape
    assert made_calls > 0


def _check_calls(message: Any) -> list[str]:
    names = []
    for call in message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        names.append(call.function.name)
    return names


@pytest.mark.parametrize("parallel", [True, None, False])
def test_the_fallback_makes_several_calls_unless_told_not_to(fallback: Any, parallel: bool) -> None:
    """Several calls in one reply (each valid, no two the same, the same streamed) when
    ``parallel_tool_calls`` is true or left out (OpenAI's default); exactly one when false."""
    most = 0
    for seed in range(8):
        kwargs: dict[str, Any] = dict(
            model=MODEL,
            messages=PARIS,
            tools=TOOLS,
            seed=seed,
            max_tokens=400,
            **({} if parallel is None else {"parallel_tool_calls": parallel}),
        )
        r = fallback.chat.completions.create(**kwargs)
        choice = r.choices[0]
        if choice.finish_reason == "tool_calls":
            most = max(most, len(_check_calls(choice.message)))
            calls = [
                (c.function.name, json.loads(c.function.arguments))
                for c in choice.message.tool_calls
            ]
            assert all(calls.index(c) == i for i, c in enumerate(calls)), calls  # no repeat
        shape = _shape(choice.message, choice.finish_reason)
        assert _streamed_shape(fallback.chat.completions.create(stream=True, **kwargs)) == shape
    assert most >= 2 if parallel is not False else most == 1


PING = [  # a tool whose only call is {"name": "ping", "arguments": {}}: any second one repeats it
    {
        "type": "function",
        "function": {
            "name": "ping",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    }
]


@pytest.mark.parametrize("tool_choice", [None, "required"], ids=["auto", "required"])
def test_a_repeated_call_ends_the_reply(
    fallback: Any, tools_model: Path, tool_choice: str | None
) -> None:
    """A repeat forced: one tool with one possible call, and "," (another call follows) made
    far likelier than "]" by logit_bias. The reply ends at the repeat: the call once,
    finish_reason "tool_calls", the same streamed, far fewer tokens than max_tokens (without the
    stop the model writes ping after ping until max_tokens)."""
    from transformers import AutoTokenizer

    comma = AutoTokenizer.from_pretrained(str(tools_model)).convert_tokens_to_ids(",")
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    calls = 0
    for seed in range(4):
        kwargs: dict[str, Any] = dict(
            model=MODEL,
            messages=PARIS,
            tools=PING,
            seed=seed,
            max_tokens=300,
            logit_bias={str(comma): 50},
            **extra,
        )
        r = fallback.chat.completions.create(**kwargs)
        choice = r.choices[0]
        if tool_choice is None and choice.finish_reason != "tool_calls":
            continue  # the fallback's random model chose to answer in text
        assert choice.finish_reason == "tool_calls", choice
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
            ("ping", "{}")
        ]
        assert r.usage.completion_tokens < 100, r.usage
        shape = _shape(choice.message, choice.finish_reason)
        assert _streamed_shape(fallback.chat.completions.create(stream=True, **kwargs)) == shape
        calls += 1
    assert calls > 0


def test_response_format_shapes_the_fallback_answer(fallback: Any) -> None:
    """``response_format`` with auto tools: the answer is JSON of the requested schema (its text
    is the content), or the reply is calls; the same streamed, also when cut by max_tokens."""
    kinds = set()
    for seed, max_tokens in enumerate([300] * 8 + [12, 20, 30, 45]):
        kwargs: dict[str, Any] = dict(
            model=MODEL,
            messages=PARIS,
            tools=WEATHER_TOOL,
            seed=seed,
            max_tokens=max_tokens,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": structured.PERSON},
            },
        )
        r = fallback.chat.completions.create(**kwargs)
        choice = r.choices[0]
        if choice.finish_reason == "tool_calls":
            assert _check_calls(choice.message) and choice.message.content is None
            kinds.add("calls")
        elif choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), structured.PERSON)
            assert not choice.message.tool_calls
            kinds.add("answer")
        else:
            assert not (choice.message.content or "").startswith('{"response"')
            kinds.add("cut")
        shape = _shape(choice.message, choice.finish_reason)
        assert _streamed_shape(fallback.chat.completions.create(stream=True, **kwargs)) == shape
    assert kinds == {"calls", "answer", "cut"}


def test_json_object_shapes_the_fallback_answer_and_regex_is_refused(fallback: Any) -> None:
    import openai

    for seed in range(6):
        r = fallback.chat.completions.create(
            model=MODEL,
            messages=PARIS,
            tools=WEATHER_TOOL,
            seed=seed,
            max_tokens=300,
            response_format={"type": "json_object"},
        )
        choice = r.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
    with pytest.raises(openai.BadRequestError) as err:
        fallback.chat.completions.create(
            model=MODEL, messages=PARIS, tools=WEATHER_TOOL, extra_body={"guided_regex": "a+"}
        )
    assert "guided_regex" in str(err.value) and "response_format" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:  # "required": the reply is the calls
        fallback.chat.completions.create(
            model=MODEL,
            messages=PARIS,
            tools=WEATHER_TOOL,
            tool_choice="required",
            response_format={"type": "json_object"},
        )
    assert "response_format: cannot be combined with tool_choice 'required'" in str(err.value)


@pytest.mark.parametrize(
    "tool_choice",
    [None, "required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["auto", "required", "named"],
)
@pytest.mark.parametrize("server", ["native", "fallback"])
def test_cut_by_max_tokens_same_shape_streamed(
    request: pytest.FixtureRequest, server: str, tool_choice: Any
) -> None:
    """A call cut by max_tokens: ``tool_calls`` with the arguments so far and finish_reason
    "length", the same streamed and unstreamed."""
    client = request.getfixturevalue(server)
    if server == "native" and tool_choice is None:
        pytest.skip("a random model writes no Hermes call unconstrained")
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    calls_cut = 0
    for seed, max_tokens in enumerate([8, 20, 30, 40]):
        kwargs: dict[str, Any] = dict(
            model=MODEL, messages=PARIS, tools=WEATHER_TOOL, seed=seed, max_tokens=max_tokens
        )
        r = client.chat.completions.create(**kwargs, **extra)
        shape = _shape(r.choices[0].message, r.choices[0].finish_reason)
        if shape[2] != "length":  # finished within max_tokens
            continue
        assert [name for name, _ in shape[1]] in ([], ["get_weather"]), shape
        if tool_choice is not None:  # the reply is constrained JSON: never content
            assert shape[0] == "", shape
        calls_cut += bool(shape[1])
        streamed = client.chat.completions.create(stream=True, **kwargs, **extra)
        assert _streamed_shape(streamed) == shape
    assert tool_choice is None or calls_cut > 0

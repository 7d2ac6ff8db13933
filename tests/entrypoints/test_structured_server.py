"""Structured output and tool calling through the OpenAI API, with the official client.

The server runs a tiny random Llama whose tokenizer carries a Hermes/Qwen-style chat template that
renders tools (built here). Random weights write nonsense, so every assertion is one the
constraint guarantees: the JSON validates, the arguments validate, the choice is one of them.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.entrypoints.conftest import API_KEY, ServerHandle, start_server

MODEL = "tiny-tools"
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n<tools>\n"
    "{%- for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    'Answer with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n'
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{%- for c in m.tool_calls %}<tool_call>"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,7}$"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 99},
                    "b": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


class Person(BaseModel):
    name: str = Field(pattern="^[a-z]{1,8}$")
    age: int = Field(ge=0, le=120)
    color: Literal["red", "green", "blue"]
    ok: bool


@pytest.fixture(scope="module")
def tools_model(llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a tools-capable chat template in its tokenizer config."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tools-model")
    for f in llama_path.iterdir():
        if f.is_file():
            shutil.copy(f, folder / f.name)
    tok = AutoTokenizer.from_pretrained(str(llama_path))
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(str(folder))
    # Tool definitions take many tokens of this tiny vocabulary: a longer window (RoPE does not
    # care, the weights are random anyway).
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _serve(model: Path, tool_call_parser: str) -> Iterator[ServerHandle]:
    from pagedllm.engine.async_engine import AsyncEngine
    from pagedllm.entrypoints.openai.api_server import ServerSettings, build_app, model_info

    engine = AsyncEngine.from_engine_args(
        str(model),
        "cpu",
        dtype="float32",
        num_kv_blocks=2048,
        block_size=8,
        max_model_len=2048,
        max_num_seqs=32,
        log_stats_interval=None,
    )
    settings = ServerSettings(api_key=API_KEY, tool_call_parser=tool_call_parser)
    app = build_app(engine, model_info(engine, [MODEL]), settings)
    srv, thread, port = start_server(app)
    yield ServerHandle(f"http://127.0.0.1:{port}", engine, srv, thread)
    srv.should_exit = True
    thread.join(30)


@pytest.fixture(scope="module")
def tserver(tools_model: Path) -> Iterator[ServerHandle]:
    yield from _serve(tools_model, "hermes")


@pytest.fixture(scope="module")
def oai(tserver: ServerHandle) -> Any:
    import openai

    return openai.OpenAI(base_url=tserver.v1, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture()
def raw(tserver: ServerHandle) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=tserver.base_url, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}
    ) as c:
        yield c


def test_response_format_json_schema(oai: Any) -> None:
    for seed in range(3):
        r = oai.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            seed=seed,
            max_tokens=100,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON},
            },
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_parse_with_a_pydantic_model(oai: Any) -> None:
    parse = getattr(oai.beta.chat.completions, "parse", None) or oai.chat.completions.parse
    r = parse(model=MODEL, messages=MESSAGES, response_format=Person, seed=1, max_tokens=100)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person)


def test_guided_extras_on_completions(oai: Any) -> None:
    r = oai.completions.create(
        model=MODEL,
        prompt="Pick:",
        max_tokens=20,
        n=3,
        seed=5,
        extra_body={"guided_choice": ["alpha", "beta", "gamma"]},
    )
    assert {c.text for c in r.choices} <= {"alpha", "beta", "gamma"}
    r = oai.completions.create(
        model=MODEL,
        prompt="Code:",
        max_tokens=20,
        seed=5,
        extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"},
    )
    assert len(r.choices[0].text) == 6 and r.choices[0].text[3] == "-"
    r = oai.completions.create(
        model=MODEL, prompt="JSON:", max_tokens=100, seed=2, extra_body={"guided_json": PERSON}
    )
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    r = oai.completions.create(
        model=MODEL,
        prompt="Sum:",
        max_tokens=30,
        seed=2,
        extra_body={"guided_grammar": 'start: "(" /[0-9]{1,2}/ ")"'},
    )
    assert r.choices[0].text.startswith("(") and r.choices[0].text.endswith(")")
    # Streamed: the pieces add up to a choice.
    chunks = oai.completions.create(
        model=MODEL,
        prompt="Pick:",
        max_tokens=20,
        seed=9,
        stream=True,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert "".join(c.choices[0].text for c in chunks) in ("yes", "no")


def collect_tool_calls(stream: Any) -> list[dict[str, Any]]:
    """Tool calls put together from a ``create(stream=True)`` stream, per index, each with its
    argument deltas; checks OpenAI's shape: the first delta of a call carries its id, type and
    name, later ones only the index and an arguments fragment."""
    calls: list[dict[str, Any]] = []
    for chunk in stream:
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or []:
                if tc.index == len(calls):
                    assert tc.id and tc.id.startswith("call_") and tc.type == "function", tc
                    assert tc.function and tc.function.name, tc
                    args = tc.function.arguments or ""
                    calls.append({"name": tc.function.name, "arguments": args, "pieces": [args]})
                    continue
                assert tc.id is None and tc.type is None and tc.function.name is None, tc
                piece = tc.function.arguments or ""
                calls[tc.index]["arguments"] += piece
                calls[tc.index]["pieces"].append(piece)
    return calls


def _check_calls(calls: Any, name: str | None = None) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert name is None or call.function.name == name
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_tool_choice(oai: Any) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, seed=3, tool_choice=choice, max_tokens=100
    )
    assert r.choices[0].finish_reason == "tool_calls"
    _check_calls(r.choices[0].message.tool_calls, "get_weather")


def test_named_tool_choice_streamed(oai: Any) -> None:
    choice = {"type": "function", "function": {"name": "add"}}
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        seed=4,
        tool_choice=choice,
        max_tokens=100,
        stream=True,
    )
    ids, names, args, reasons = set(), [], "", []
    for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                assert tc.index == 0
                if tc.id:
                    ids.add(tc.id)
                if tc.function and tc.function.name:
                    names.append(tc.function.name)
                if tc.function and tc.function.arguments:
                    args += tc.function.arguments
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert len(ids) == 1 and names == ["add"] and reasons == ["tool_calls"]
    jsonschema.validate(json.loads(args), SCHEMAS["add"])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice(oai: Any, parallel: bool) -> None:
    r = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        seed=6,
        tool_choice="required",
        parallel_tool_calls=parallel,
        max_tokens=200,
    )
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
    calls = r.choices[0].message.tool_calls
    _check_calls(calls)
    if not parallel:
        assert len(calls) == 1
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        seed=6,
        tool_choice="required",
        parallel_tool_calls=parallel,
        max_tokens=200,
        stream=True,
    )
    streamed = collect_tool_calls(stream)
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (t.function.name, t.function.arguments) for t in calls
    ]


# "auto" with a constraint that makes the random model write one call in the parser's format.
WEATHER_CALL = (
    '"get_weather", "{key}": \\{{"city": "[A-Z][a-z]{{7}}", "unit": "(celsius|fahrenheit)"\\}}'
)
AUTO_CALLS = {  # parser -> (the constraint, content unstreamed, content streamed)
    "hermes": (
        '(Sure\\. )<tool_call>\\{"name": '
        + WEATHER_CALL.format(key="arguments")
        + "\\}</tool_call>",
        "Sure.",
        "Sure. ",
    ),
    "llama3_json": ('\\{"name": ' + WEATHER_CALL.format(key="parameters") + "\\}", None, ""),
}


@pytest.fixture(scope="module")
def l3server(tools_model: Path) -> Iterator[ServerHandle]:
    yield from _serve(tools_model, "llama3_json")


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_auto_tool_calls_stream_their_arguments(
    request: pytest.FixtureRequest, parser: str
) -> None:
    """Streamed "auto" calls arrive as argument deltas while they are generated (several per
    call), and add up to the unstreamed reply's call."""
    import openai

    server = request.getfixturevalue("tserver" if parser == "hermes" else "l3server")
    client = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="auto",
        seed=11,
        max_tokens=200,
        extra_body={"guided_regex": AUTO_CALLS[parser][0]},
    )
    r = client.chat.completions.create(**kwargs)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
    assert r.choices[0].message.content == AUTO_CALLS[parser][1]
    (call,) = r.choices[0].message.tool_calls
    _check_calls([call], "get_weather")
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    content = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
    reasons = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
    assert content == AUTO_CALLS[parser][2] and reasons == ["tool_calls"]
    calls = collect_tool_calls(chunks)
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", call.function.arguments)
    ]
    assert len([p for p in calls[0]["pieces"] if p]) > 1, calls[0]["pieces"]


def test_required_tool_calls_stream_with_the_stream_helper(oai: Any) -> None:
    """The official client's stream helper sees every "required" call's arguments grow delta by
    delta, and its final completion has the unstreamed reply's calls."""
    kwargs: dict[str, Any] = dict(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", seed=6, max_tokens=200
    )
    r = oai.chat.completions.create(**kwargs)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
    expected = [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls]
    helper = getattr(oai.chat.completions, "stream", None) or oai.beta.chat.completions.stream
    deltas: dict[int, list[str]] = {}
    done: dict[int, str] = {}
    with helper(**kwargs) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                deltas.setdefault(event.index, []).append(event.arguments_delta)
            elif event.type == "tool_calls.function.arguments.done":
                done[event.index] = event.arguments
        final = stream.get_final_completion()
    got = [(t.function.name, t.function.arguments) for t in final.choices[0].message.tool_calls]
    assert got == expected and final.choices[0].finish_reason == "tool_calls"
    assert [done[i] for i in sorted(done)] == [args for _, args in expected]
    for i, (name, args) in enumerate(expected):
        assert "".join(deltas[i]) == args
        if any(earlier == name for earlier, _ in expected[:i]):
            # A call to a tool already called goes out once complete: it may be a repeat,
            # which ends the reply unsent (tool_repeats).
            assert [d for d in deltas[i] if d] == [args], deltas[i]
        elif args != "{}":
            assert len([d for d in deltas[i] if d]) > 1, deltas[i]


def test_history_with_tool_calls_and_auto(oai: Any) -> None:
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees"},
    ]
    r = oai.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    stream = oai.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, max_tokens=8, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    if r.choices[0].message.tool_calls is None:
        assert text == r.choices[0].message.content


BAD = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                },
            }
        },
        "response_format",
    ),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "start: ???"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                    },
                }
            ]
        },
        "tools",
    ),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "oops"}}]}, "tools"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_json": PERSON}, "guided_json"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("extra", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_input_is_a_400_naming_the_parameter(
    raw: httpx.Client, extra: dict, param: str, stream: bool
) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "stream": stream, **extra}
    r = raw.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["message"].startswith(param), err
    ok = raw.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    )
    assert ok.status_code == 200


def test_bad_constraint_on_completions(raw: httpx.Client) -> None:
    r = raw.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "x",
            "max_tokens": 4,
            "guided_json": {"type": "nonsense"},
            "stream": True,
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json", r.text

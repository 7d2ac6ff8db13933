"""Tool calls on the real demo model (SmolLM2-135M-Instruct, whose chat template has no tools
branch) with no server flag and ``tool_choice`` left out: the fallback makes it call the tool.

Skipped when the model is not in the user's cache (``pagedllm serve --demo`` fetches it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.entrypoints.conftest import API_KEY, start_server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def demo_client() -> Iterator[Any]:
    import openai

    from pagedllm.engine.async_engine import AsyncEngine
    from pagedllm.entrypoints.demo_model import fetch_demo_model
    from pagedllm.entrypoints.openai.api_server import ServerSettings, build_app, model_info

    fetched = fetch_demo_model(download=False)
    if fetched.path is None:
        pytest.skip(f"the demo model is not cached: {fetched.reason}")
    engine = AsyncEngine.from_engine_args(
        str(fetched.path), "cpu", dtype="float32", kv_cache_space=0.25, log_stats_interval=None
    )
    app = build_app(engine, model_info(engine, ["demo"]), ServerSettings(api_key=API_KEY))
    srv, thread, port = start_server(app)
    yield openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0, timeout=300
    )
    srv.should_exit = True
    thread.join(30)


def _shape(message: Any, reason: str | None) -> tuple[Any, ...]:
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    return message.content or "", calls, reason


def _streamed_shape(stream: Any) -> tuple[Any, ...]:
    content, calls, reason = "", [], None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                if tc.index == len(calls):
                    calls.append([tc.function.name, ""])
                calls[tc.index][1] += tc.function.arguments or ""
            reason = choice.finish_reason or reason
    return content, [tuple(c) for c in calls], reason


def test_the_demo_model_calls_get_weather_with_no_flags(demo_client: Any) -> None:
    """At the server's default sampling, seeded so that the test is repeatable: every reply is
    calls or an answer, most are get_weather calls, and no list of calls runs to max_tokens:
    several calls per reply are allowed (OpenAI's default), and the reply ends at a repeated
    call (before that stop the demo model wrote the same call until max_tokens in 3 replies of
    8). Streamed and unstreamed replies agree."""
    calls = 0
    for seed in range(8):
        kwargs: dict[str, Any] = dict(
            model="demo",
            messages=[{"role": "user", "content": "What's the weather in Paris?"}],
            tools=[WEATHER],
            max_tokens=120,
            seed=seed,
        )
        r = demo_client.chat.completions.create(**kwargs)
        choice = r.choices[0]
        # A text answer may run long; calls never do (the symptom of repeats: a cut list).
        assert choice.finish_reason != "length" or not choice.message.tool_calls, (seed, choice)
        if seed < 3:
            streamed = _streamed_shape(demo_client.chat.completions.create(stream=True, **kwargs))
            assert streamed == _shape(choice.message, choice.finish_reason)
        if choice.finish_reason != "tool_calls":
            assert choice.message.tool_calls is None and choice.message.content is not None
            continue
        made = [
            (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
        ]
        assert all(made.index(c) == i for i, c in enumerate(made)), made  # no repeat
        for name, args in made:
            assert name == "get_weather" and isinstance(args["city"], str)
        assert choice.message.content is None
        calls += 1
    assert calls >= 5

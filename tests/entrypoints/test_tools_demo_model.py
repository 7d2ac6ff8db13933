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


def test_the_demo_model_calls_get_weather_with_no_flags(demo_client: Any) -> None:
    """At the server's default sampling, seeded so that the test is repeatable: every reply is
    a call or an answer, and most are a get_weather call (about 5 in 6 when this was written)."""
    calls = 0
    for seed in range(5):
        r = demo_client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "What's the weather in Paris?"}],
            tools=[WEATHER],
            max_tokens=60,
            seed=seed,
        )
        choice = r.choices[0]
        if choice.finish_reason != "tool_calls":
            assert choice.message.tool_calls is None and choice.message.content is not None
            continue
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and choice.message.content is None
        assert isinstance(json.loads(call.function.arguments)["city"], str)
        calls += 1
    assert calls >= 3

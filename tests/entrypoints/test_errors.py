"""Every invalid request: its status, the OpenAI error shape, and that the server still serves.

Bad input must be refused before a response starts, for streaming requests too: a 4xx with a
JSON body, never a 200 followed by an error event.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.entrypoints.conftest import API_KEY, MAX_MODEL_LEN, MODEL_NAME

OK = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 1, "temperature": 0}
CHAT_OK = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
LONG_PROMPT = list(range(3, 3 + MAX_MODEL_LEN + 5))

# (name, body changes (None deletes a field), status, param, code)
COMPLETION_CASES: list[tuple[str, dict[str, Any], int, str | None, str | None]] = [
    ("unknown model", {"model": "gpt-5"}, 404, "model", "model_not_found"),
    ("missing model", {"model": None}, 400, "model", "missing_required_field"),
    ("missing prompt", {"prompt": None}, 400, "prompt", "missing_required_field"),
    ("empty prompt list", {"prompt": []}, 400, "prompt", None),
    ("empty string prompt", {"prompt": ""}, 400, "prompt", None),
    ("mixed prompt list", {"prompt": [[1, 2], "text"]}, 400, "prompt", None),
    ("token id past vocab", {"prompt": [5, 10_000]}, 400, "prompt", "invalid_token_id"),
    ("negative token id", {"prompt": [[5, -1]]}, 400, "prompt", "invalid_token_id"),
    ("prompt beyond window", {"prompt": LONG_PROMPT}, 400, "prompt", "context_length_exceeded"),
    (
        "prompt + max_tokens beyond window",
        {"max_tokens": MAX_MODEL_LEN},
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    ("max_tokens zero", {"max_tokens": 0}, 400, "max_tokens", None),
    ("max_tokens not a number", {"max_tokens": "many"}, 400, "max_tokens", "invalid_value"),
    ("negative temperature", {"temperature": -0.5}, 400, "temperature", None),
    ("top_p above one", {"top_p": 1.5}, 400, "top_p", None),
    ("top_k below -1", {"top_k": -3}, 400, "top_k", None),
    ("min_p above one", {"min_p": 2}, 400, "min_p", None),
    ("n zero", {"n": 0}, 400, "n", None),
    ("best_of below n", {"n": 3, "best_of": 2, "temperature": 1}, 400, "best_of", None),
    ("presence_penalty out of range", {"presence_penalty": 3}, 400, "presence_penalty", None),
    ("frequency_penalty out of range", {"frequency_penalty": -3}, 400, "frequency_penalty", None),
    ("repetition_penalty zero", {"repetition_penalty": 0}, 400, "repetition_penalty", None),
    ("min_tokens above max_tokens", {"min_tokens": 5}, 400, "min_tokens", None),
    ("too many logprobs", {"logprobs": 50}, 400, "logprobs", None),
    ("negative logprobs", {"logprobs": -1}, 400, "logprobs", None),
    ("logit_bias key not a token", {"logit_bias": {"abc": 1}}, 400, "logit_bias", None),
    ("logit_bias token past vocab", {"logit_bias": {"99999": 1}}, 400, "logit_bias", None),
    ("logit_bias value too big", {"logit_bias": {"5": 1000}}, 400, "logit_bias", None),
    ("stop_token_ids past vocab", {"stop_token_ids": [99999]}, 400, "stop_token_ids", None),
    ("empty stop string", {"stop": [""]}, 400, "stop", None),
    ("suffix unsupported", {"suffix": "tail"}, 400, "suffix", "unsupported_parameter"),
    (
        "stream_options without stream",
        {"stream_options": {"include_usage": True}},
        400,
        "stream_options",
        None,
    ),
    (
        "streaming best_of > n",
        {"stream": True, "best_of": 2, "temperature": 1},
        400,
        "best_of",
        None,
    ),
    ("bad sampling value while streaming", {"stream": True, "top_p": 7}, 400, "top_p", None),
    (
        "window exceeded while streaming",
        {"stream": True, "prompt": LONG_PROMPT},
        400,
        "prompt",
        "context_length_exceeded",
    ),
]

CHAT_CASES: list[tuple[str, dict[str, Any], int, str | None, str | None]] = [
    ("missing messages", {"messages": None}, 400, "messages", "missing_required_field"),
    ("empty messages", {"messages": []}, 400, "messages", None),
    ("message without role", {"messages": [{"content": "hi"}]}, 400, "messages", None),
    (
        "image content",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                }
            ]
        },
        400,
        "messages",
        "unsupported_content",
    ),
    ("top_logprobs without logprobs", {"top_logprobs": 2}, 400, "top_logprobs", None),
    ("too many top_logprobs", {"logprobs": True, "top_logprobs": 50}, 400, "top_logprobs", None),
    (
        # response_format now shapes the fallback's text answer; a regex cannot join its JSON.
        "auto tool choice (the fallback's constraint) with guided_regex",
        {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "guided_regex": "a+",
        },
        400,
        "guided_regex",
        None,
    ),
    (
        "tool without a name",
        {"tools": [{"type": "function", "function": {}}], "tool_choice": "required"},
        400,
        "tools",
        None,
    ),
    (
        "unknown response_format",
        {"response_format": {"type": "yaml"}},
        400,
        "response_format",
        None,
    ),
    (
        "invalid json schema",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"type": "nonsense"}},
            }
        },
        400,
        "response_format",
        None,
    ),
    ("invalid guided_regex", {"guided_regex": "("}, 400, "guided_regex", None),
    (
        "max_completion_tokens beyond window",
        {"max_completion_tokens": MAX_MODEL_LEN},
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    ("unknown model", {"model": "nope"}, 404, "model", "model_not_found"),
    (
        "bad temperature while streaming",
        {"stream": True, "temperature": -1},
        400,
        "temperature",
        None,
    ),
]


def _body(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    body = dict(base)
    for key, value in changes.items():
        if value is None:
            body.pop(key, None)
        else:
            body[key] = value
    return body


def _check_error(r: Any, status: int, param: str | None, code: str | None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def _still_serving(http: Any) -> None:
    r = http.post("/v1/completions", json=OK)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(
    "name,changes,status,param,code", COMPLETION_CASES, ids=[c[0] for c in COMPLETION_CASES]
)
def test_completion_errors(
    http: Any, name: str, changes: dict[str, Any], status: int, param: str | None, code: str | None
) -> None:
    _check_error(http.post("/v1/completions", json=_body(OK, changes)), status, param, code)
    _still_serving(http)


@pytest.mark.parametrize(
    "name,changes,status,param,code", CHAT_CASES, ids=[c[0] for c in CHAT_CASES]
)
def test_chat_errors(
    http: Any, name: str, changes: dict[str, Any], status: int, param: str | None, code: str | None
) -> None:
    _check_error(
        http.post("/v1/chat/completions", json=_body(CHAT_OK, changes)), status, param, code
    )
    r = http.post("/v1/chat/completions", json=CHAT_OK)
    assert r.status_code == 200, r.text


def test_malformed_bodies(server: Any, http: Any) -> None:
    headers = {"Content-Type": "application/json"}
    for raw in (b"{not json", b"", b"[1, 2]", b'"text"', b'{"model": '):
        err = _check_error(
            http.post("/v1/completions", content=raw, headers=headers), 400, None, "invalid_json"
        )
        assert "JSON" in err["message"]
        _still_serving(http)
    big = b'{"model": "' + b"x" * (80 * 1024) + b'"}'
    _check_error(
        http.post("/v1/completions", content=big, headers=headers), 413, None, "request_too_large"
    )
    _still_serving(http)
    server.assert_all_blocks_free()


def test_routes_and_methods(http: Any) -> None:
    err = _check_error(http.get("/v1/nothing-here"), 404, None, None)
    assert err["type"] == "not_found_error"
    _check_error(http.get("/v1/completions"), 405, None, None)
    _still_serving(http)


def test_chat_without_template_is_a_clear_400(server: Any) -> None:
    import asyncio

    import httpx

    from pagedllm.entrypoints.openai.api_server import ServerSettings, build_app, model_info

    app = build_app(
        server.engine, model_info(server.engine, [MODEL_NAME]), ServerSettings(), owns_engine=False
    )

    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            return await c.post("/v1/chat/completions", json=CHAT_OK)

    r = asyncio.run(main())
    err = _check_error(r, 400, "messages", "chat_template_missing")
    assert "--chat-template" in err["message"]


def test_api_key(server: Any, client: Any) -> None:
    import httpx
    import openai

    base = server.base_url
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": API_KEY},
        {"Authorization": f"Basic {API_KEY}"},
    ):
        for method, path in (
            ("GET", "/v1/models"),
            ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"),
            ("POST", "/tokenize"),
        ):
            r = httpx.request(method, base + path, json=OK, headers=headers)
            err = _check_error(r, 401, None, "invalid_api_key")
            assert err["type"] == "authentication_error"
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.get(base + "/metrics").status_code == 200
    bad = openai.OpenAI(base_url=server.v1, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert client.models.list().data[0].id == MODEL_NAME


class StepFailer:
    """Wraps the engine's step(); raises once when armed (lives in the engine core process)."""

    def __init__(self, step: Any) -> None:
        import threading

        self.step = step
        self.armed = threading.Event()

    def __call__(self) -> Any:
        if self.armed.is_set():
            self.armed.clear()
            raise RuntimeError("injected step failure")
        return self.step()


def _install_failer(engine: Any) -> None:
    engine.step = StepFailer(engine.step)


def _arm_failer(engine: Any) -> None:
    engine.step.armed.set()


def _remove_failer(engine: Any) -> None:
    if isinstance(engine.step, StepFailer):
        engine.step = engine.step.step


def test_engine_step_failure_is_reported_and_the_server_recovers(server: Any, http: Any) -> None:
    import json

    server.in_core(_install_failer)
    try:
        # Non-streaming: a 500 in the usual error shape.
        server.in_core(_arm_failer)
        r = http.post("/v1/completions", json=OK)
        err = _check_error(r, 500, None, None)
        assert err["type"] == "internal_server_error" and "injected step failure" in err["message"]
        _still_serving(http)
        # Streaming: the stream has begun, so the error comes in-band, then [DONE].
        body = {**OK, "max_tokens": 60, "ignore_eos": True, "stream": True}
        events = []
        with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        server.in_core(_arm_failer)
    finally:
        server.in_core(_remove_failer)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "internal_server_error" and "injected" in error["message"]
    assert server.engine.is_healthy
    _still_serving(http)
    server.assert_all_blocks_free()


def python_answer(engine: Any, prompt_ids: list[int], max_tokens: int | None) -> str | None:
    """``add_request`` in the engine core (``server.in_core``): its refusal, None if taken."""
    from pagedllm import SamplingParams

    try:
        engine.add_request(
            "python-answer", {"prompt_token_ids": prompt_ids}, SamplingParams(max_tokens=max_tokens)
        )
    except ValueError as exc:
        return str(exc)
    engine.abort_request("python-answer")
    return None


@pytest.mark.parametrize("extra", [0, 1, 1000])
def test_max_tokens_past_the_context_is_the_engines_answer(
    server: Any, http: Any, extra: int
) -> None:
    """The engine defaults and checks ``max_tokens``; the server passes the field on and
    answers what Python callers get, word for word, as an OpenAI-shaped 400."""
    prompt = list(range(3, 23))
    max_tokens = MAX_MODEL_LEN - len(prompt) + extra  # extra 0: exactly the context
    server.wait_idle()
    expected = server.in_core(python_answer, prompt, max_tokens)
    body = {**OK, "prompt": prompt, "max_tokens": max_tokens}
    r = http.post("/v1/completions", json=body)
    if extra == 0:
        assert expected is None and r.status_code == 200, r.text
        return
    assert expected is not None and expected.startswith("max_tokens: ")
    err = _check_error(r, 400, "max_tokens", "context_length_exceeded")
    assert err["message"] == expected
    chat = {**CHAT_OK, "max_completion_tokens": MAX_MODEL_LEN + extra}
    err = _check_error(
        http.post("/v1/chat/completions", json=chat), 400, "max_tokens", "context_length_exceeded"
    )
    assert err["message"].startswith("max_tokens: this model's maximum context length is 128")
    _still_serving(http)
    server.assert_all_blocks_free()

"""Hostile clients against the live server: each gets a clear 4xx, nobody else notices.

Every case here was accepted before and either blocked every later request (n above
max_num_seqs waited at the head of the queue), failed the streams batched with it (a top_k past
a C long), or was silently ignored (functions, tool_choice without tools, a text/plain body).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import httpx
import pytest

from tests.entrypoints.conftest import API_KEY, MODEL_NAME, small_core_client, start_server

INNOCENT = ["The quick brown fox", "def fibonacci(n):", "Paged attention keeps", "import os"]
STREAM_TOKENS = 40
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
DONE_EVENT = "[DONE]"

# (route, body, param named in the 400)
HOSTILE: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {"prompt": "hello", "max_tokens": 4, "n": 257, "temperature": 1}, "n"),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 4, "n": 1000, "temperature": 1}, "n"),
    (
        "/v1/completions",
        {"prompt": "hello", "max_tokens": 4, "best_of": 300, "temperature": 1},
        "best_of",
    ),
    ("/v1/chat/completions", {**CHAT, "n": 257, "temperature": 1}, "n"),
    (
        "/v1/completions",
        {
            "prompt": "hello world",
            "max_tokens": 4,
            "temperature": 0.8,
            "top_k": 9223372036854775808,
        },
        "top_k",
    ),
    (
        "/v1/completions",
        {"prompt": "hello world", "max_tokens": 4, "temperature": 0.8, "top_k": 100000},
        "top_k",
    ),
    ("/v1/chat/completions", {**CHAT, "temperature": 0.8, "top_k": 1e20}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": "HUGE"}, "temperature"),
    (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 4, "logit_bias": {"5": "HUGE"}},
        "logit_bias",
    ),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "stop": ["x"] * 100}, "stop"),
    (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 4, "repetition_penalty": 1e30},
        "repetition_penalty",
    ),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "priority": 2**64}, "priority"),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ("/v1/chat/completions", {**CHAT, "function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"schema": {}}}, "response_format"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "frobnicate": True}, "frobnicate"),
]


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def _stream_tokens(base: str, prompt: str, out: dict[str, str]) -> None:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": STREAM_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text, events = [], []
    with httpx.stream(
        "POST",
        base + "/v1/completions",
        json=body,
        timeout=120,
        headers={"Authorization": f"Bearer {API_KEY}"},
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    for e in events[:-1]:
        chunk = json.loads(e)
        assert "error" not in chunk, chunk
        text.append(chunk["choices"][0]["text"])
    assert events[-1] == DONE_EVENT
    out[prompt] = "".join(text)


def greedy_baseline(http: Any) -> dict[str, str]:
    """Each innocent prompt's greedy text when served alone: what its stream must reproduce."""
    baseline = {}
    for p in INNOCENT:
        r = http.post(
            "/v1/completions",
            json={
                "model": MODEL_NAME,
                "prompt": p,
                "temperature": 0,
                "max_tokens": STREAM_TOKENS,
                "ignore_eos": True,
            },
        )
        baseline[p] = r.json()["choices"][0]["text"]
    return baseline


def test_hostile_requests_get_400s_while_innocent_streams_finish(server: Any, http: Any) -> None:
    baseline = greedy_baseline(http)
    got: dict[str, str] = {}
    threads = [
        threading.Thread(target=_stream_tokens, args=(server.base_url, p, got)) for p in INNOCENT
    ]
    for t in threads:
        t.start()
    for route, body, param in HOSTILE:
        for stream in (False, True):
            raw = json.dumps({"model": MODEL_NAME, **body, "stream": stream})
            r = http.post(
                route,
                content=raw.replace('"HUGE"', "1e400"),
                timeout=10,
                headers={"Content-Type": "application/json"},
            )
            err = _error(r, 400)
            assert err["param"] == param and param in err["message"], (body, err)
    r = http.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt": "A", "max_tokens": 2}, timeout=30
    )  # a later request is served, not queued behind the hostile ones
    assert r.status_code == 200, r.text
    for t in threads:
        t.join(120)
    assert got == baseline
    server.assert_all_blocks_free()


def test_harmless_openai_fields_are_still_accepted(http: Any) -> None:
    r = http.post(
        "/v1/chat/completions",
        json={
            **CHAT,
            "store": False,
            "metadata": {"a": "b"},
            "tool_choice": "none",
            "response_format": {"type": "text"},
        },
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "content_type, body",
    [
        ("text/plain", json.dumps({"model": MODEL_NAME, "prompt": "hi"})),
        ("application/x-www-form-urlencoded", "model=tiny-llama&prompt=hi"),
        (
            "multipart/form-data; boundary=xx",
            '--xx\r\nContent-Disposition: form-data; name="model"\r\n\r\ntiny-llama\r\n--xx--\r\n',
        ),
        (None, json.dumps({"model": MODEL_NAME, "prompt": "hi"})),
    ],
)
def test_only_json_bodies_are_read(server: Any, content_type: str | None, body: str) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    if content_type is not None:
        headers["Content-Type"] = content_type
    for route in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        r = httpx.post(server.base_url + route, content=body.encode(), headers=headers)
        assert _error(r, 415)["code"] == "unsupported_media_type"
    r = httpx.post(
        server.base_url + "/v1/completions",
        headers={**headers, "Content-Type": "application/json; charset=utf-8"},
        content=json.dumps({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}).encode(),
    )
    assert r.status_code == 200, r.text


def test_docs_are_behind_the_key_or_off(server: Any) -> None:
    from pagedllm.entrypoints.openai.api_server import ServerSettings, build_app, model_info

    for path in ("/docs", "/redoc", "/openapi.json"):
        assert _error(httpx.get(server.base_url + path), 401)["code"] == "invalid_api_key"
        r = httpx.get(server.base_url + path, headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200, (path, r.text)
    assert (
        "/v1/completions"
        in httpx.get(
            server.base_url + "/openapi.json", headers={"Authorization": f"Bearer {API_KEY}"}
        ).json()["paths"]
    )
    app = build_app(
        server.engine,
        model_info(server.engine, [MODEL_NAME]),
        ServerSettings(disable_docs=True),
        owns_engine=False,
    )
    paths = {getattr(r, "path", None) for r in app.routes}
    assert not paths & {"/docs", "/redoc", "/openapi.json"}


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass  # a 4xx for a garbled head is fine; what matters is that the socket closes
        return True
    except TimeoutError:
        return False


def test_idle_and_half_sent_connections_are_closed(server: Any) -> None:

    from pagedllm.entrypoints.openai.api_server import (
        ServerSettings,
        build_app,
        model_info,
        uvicorn_config,
    )

    settings = ServerSettings(timeout_keep_alive=1, read_timeout=1.0)
    app = build_app(
        server.engine, model_info(server.engine, [MODEL_NAME]), settings, owns_engine=False
    )
    srv, thread, port = start_server(
        app, config=uvicorn_config(app, settings, host="127.0.0.1", port=0, log_level="warning")
    )
    try:
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model":'
        )
        sends = [b"", b"POST /v1/compl", head]
        for data in sends:
            with socket.create_connection(("127.0.0.1", port)) as sock:
                start = time.monotonic()
                sock.sendall(data)
                assert _closed_within(sock, 5), data
                assert time.monotonic() - start < 4
        with socket.create_connection(("127.0.0.1", port)) as sock:  # idle after a response
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _closed_within(sock, 5)
    finally:
        srv.should_exit = True
        thread.join(10)


def test_request_heads_past_the_bound_get_431_and_are_closed(server: Any) -> None:
    """llhttp accepts headers of any size; the server bounds the head (``max_head_bytes``):
    one sent whole, one trickled in pieces that never end, and one just under the bound."""
    from pagedllm.entrypoints.openai.api_server import (
        ServerSettings,
        build_app,
        model_info,
        uvicorn_config,
    )

    settings = ServerSettings(max_head_bytes=4096)
    app = build_app(
        server.engine, model_info(server.engine, [MODEL_NAME]), settings, owns_engine=False
    )
    srv, thread, port = start_server(
        app, config=uvicorn_config(app, settings, host="127.0.0.1", port=0, log_level="warning")
    )

    def answer(sock: socket.socket) -> bytes:
        sock.settimeout(5)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data

    try:
        big = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 8000 + b"\r\n\r\n"
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(big)
            reply = answer(sock)  # returns once the server closes
        assert reply.startswith(b"HTTP/1.1 431 ")
        body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == "request_header_too_large"

        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            for _ in range(10):  # 10 x 500 bytes of one header that never ends
                sock.sendall(b"X-Slow: " + b"b" * 490 + b"\r\n")
                time.sleep(0.01)
            assert answer(sock).startswith(b"HTTP/1.1 431 ")

        ok = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Pad: "
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(ok + b"a" * 3000 + b"\r\n\r\n")
            assert answer(sock).startswith(b"HTTP/1.1 200 ")
    finally:
        srv.should_exit = True
        thread.join(10)


def _broken_step() -> None:  # what LLMEngine.step raises when every request fails on its own
    from pagedllm.engine.containment import EngineBrokenError

    raise EngineBrokenError("every request fails on its own: device lost")


def _break_engine(engine: Any) -> None:
    engine.step = _broken_step


def test_broken_engine_marks_health_503_and_the_server_exits_nonzero(llama_path: Any) -> None:
    import asyncio

    from pagedllm.entrypoints.openai.api_server import ServerSettings, model_info, run_server
    from tests.entrypoints.conftest import free_port

    engine = small_core_client(llama_path)

    asyncio.run(engine.call(_break_engine))
    port, result = free_port(), {}
    thread = threading.Thread(
        target=lambda: result.update(
            status=run_server(
                engine,
                model_info(engine, [MODEL_NAME]),
                ServerSettings(),
                port=port,
                log_level="warning",
            )
        ),
        daemon=True,
    )
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            assert httpx.get(base + "/health").status_code == 200
            break
        except httpx.ConnectError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    r = httpx.post(base + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi"})
    assert _error(r, 500)["type"] == "internal_server_error"
    assert _error(httpx.get(base + "/health"), 503)["type"] == "service_unavailable"
    thread.join(30)
    assert result == {"status": 1}


class _Poisoned:
    """Fails the step whenever the marked request is batched (lives in the engine core)."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def __call__(self, sched_out: Any) -> Any:
        if any(s.sampling_params.seed == 4242 for s in sched_out.seqs):
            raise RuntimeError("Overflow when unpacking long long")
        return self.real(sched_out)


def _poison(engine: Any) -> None:
    engine.executor.execute_model = _Poisoned(engine.executor.execute_model)


def _unpoison(engine: Any) -> None:
    engine.executor.__dict__.pop("execute_model", None)


def test_a_request_that_fails_the_step_is_ended_alone(server: Any, http: Any) -> None:
    baseline = greedy_baseline(http)
    server.in_core(_poison)
    try:
        _run_poisoned_and_innocent(server, http, baseline)
    finally:
        server.in_core(_unpoison)
    assert server.engine.is_healthy
    server.assert_all_blocks_free()


def _run_poisoned_and_innocent(server: Any, http: Any, baseline: dict[str, str]) -> None:
    got: dict[str, str] = {}
    threads = [
        threading.Thread(target=_stream_tokens, args=(server.base_url, p, got)) for p in INNOCENT
    ]
    for t in threads:
        t.start()
    for _ in range(3):
        r = http.post(
            "/v1/completions",
            json={
                "model": MODEL_NAME,
                "prompt": "hello world",
                "max_tokens": 8,
                "temperature": 0.8,
                "seed": 4242,
            },
        )
        err = _error(r, 500)
        assert err["type"] == "internal_server_error" and "Overflow" in err["message"]
    for t in threads:
        t.join(120)
    assert got == baseline
    assert server.engine.is_healthy
    server.assert_all_blocks_free()

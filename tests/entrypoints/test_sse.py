"""EventStreamResponse: events go out through the server's own send, and a client that leaves
closes the event generator (which is what aborts the request in the engine)."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import httpx
from fastapi import Request

from pagedllm.entrypoints.openai.sse import (
    DONE,
    SERVER_SEND,
    EventStreamResponse,
    ServerApp,
    sse_event,
)


class _Recorder:
    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    async def __call__(self, message: dict[str, Any]) -> None:
        self.messages.append(message)


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_events_bypass_the_wrapped_send_and_the_stream_ends_cleanly() -> None:
    async def events() -> Any:
        for i in range(3):
            yield sse_event({"i": i})
        yield DONE

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(3600)  # the client never leaves
        return {"type": "http.disconnect"}

    wrapped, server = _Recorder(), _Recorder()
    scope = {"type": "http", SERVER_SEND: server}
    _run(asyncio.wait_for(EventStreamResponse(events())(scope, receive, wrapped), 5))
    assert [m["type"] for m in wrapped.messages] == ["http.response.start"]
    headers = dict(wrapped.messages[0]["headers"])
    assert headers[b"content-type"].startswith(b"text/event-stream")
    assert headers[b"cache-control"] == b"no-cache"
    bodies = [m["body"] for m in server.messages]
    assert bodies == [b'data: {"i":0}\n\n', b'data: {"i":1}\n\n', b'data: {"i":2}\n\n', DONE, b""]
    assert [m["more_body"] for m in server.messages] == [True] * 4 + [False]


def test_without_the_server_send_everything_goes_through_send() -> None:
    async def events() -> Any:
        yield DONE

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    send = _Recorder()
    _run(asyncio.wait_for(EventStreamResponse(events())({"type": "http"}, receive, send), 5))
    assert [m["type"] for m in send.messages] == ["http.response.start"] + [
        "http.response.body"
    ] * 2


def test_a_client_that_leaves_closes_the_generator_before_its_first_event() -> None:
    closed = asyncio.Event()
    started = []

    async def events() -> Any:
        started.append(True)
        try:
            await asyncio.sleep(3600)  # waiting for a first token that never comes
            yield DONE
        finally:
            closed.set()

    async def main() -> list[dict[str, Any]]:
        left = asyncio.Event()

        async def receive() -> dict[str, Any]:
            await left.wait()
            return {"type": "http.disconnect"}

        send = _Recorder()
        task = asyncio.ensure_future(
            EventStreamResponse(events())({"type": "http", SERVER_SEND: send}, receive, send)
        )
        await asyncio.sleep(0.05)
        left.set()
        await asyncio.wait_for(task, 5)
        assert closed.is_set()
        return send.messages

    messages = _run(main())
    assert started and [m["type"] for m in messages] == ["http.response.start"]


def test_an_event_is_json_and_non_finite_floats_become_null() -> None:
    event = sse_event({"text": 'é\n"x"', "logprob": -math.inf, "n": [1, 2.5]})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:]) == {"text": 'é\n"x"', "logprob": None, "n": [1, 2.5]}


def test_the_app_stamps_arrival_and_the_server_send() -> None:
    app = ServerApp()
    seen: dict[str, Any] = {}

    @app.get("/probe")
    async def probe(request: Request) -> dict[str, bool]:
        seen["arrival"] = request.state.arrival_time
        seen["send"] = request.scope[SERVER_SEND]
        return {"ok": True}

    async def main() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return (await client.get("/probe")).status_code

    assert _run(main()) == 200
    assert isinstance(seen["arrival"], float) and callable(seen["send"])

"""Server-sent event streams with as little as possible between a token and its socket.

Every streamed token is one event written to one client, so what the server spends per event
is multiplied by the tokens of every stream, and on a small machine it is taken from the engine
core's step (docs/serving.md measures it). Three things are cut from that path:

- **The middleware stack.** Each of Starlette's and FastAPI's layers (server errors, exception
  handlers, body limits) wraps the ASGI ``send`` to see whether a response has *started*; none
  looks at body chunks. :class:`ServerApp` keeps the server's own ``send`` in the scope, and
  :class:`EventStreamResponse` sends its start through the wrapped one (so every layer knows it
  started) and its events through the server's, skipping four to six calls per event.
- **The task group.** Starlette's ``StreamingResponse`` runs each response in an anyio task
  group with a disconnect listener; here it is one plain task watching ``receive`` that
  cancels the stream when the client goes (which aborts the request: its generator's
  ``finally`` runs).
- **JSON.** Events are encoded with msgspec (:func:`sse_event`), several times faster than
  ``json.dumps`` for these small dicts. Non-finite floats become ``null`` (``json.dumps`` would
  write ``NaN``, which is not JSON).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import msgspec
from fastapi import FastAPI
from starlette.responses import Response

SERVER_SEND = "pagedllm.server_send"
DONE = b"data: [DONE]\n\n"

_encode = msgspec.json.Encoder().encode


def sse_event(body: Any) -> bytes:
    """One ``data:`` event holding ``body`` as JSON."""
    return b"data: " + _encode(body) + b"\n\n"


class ServerApp(FastAPI):
    """The FastAPI app, entered with two stamps in the scope: the server's own ``send`` (see
    the module docstring) and ``state["arrival_time"]`` (monotonic), where a request's TTFT and
    latency metrics start: before the event loop parsed, validated or tokenized anything."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["arrival_time"] = time.monotonic()
            scope[SERVER_SEND] = send
        await super().__call__(scope, receive, send)


class EventStreamResponse(Response):
    """A ``text/event-stream`` response of already-encoded events (bytes)."""

    media_type = "text/event-stream"

    def __init__(
        self, events: AsyncIterator[bytes], headers: Mapping[str, str] | None = None
    ) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", **(headers or {})})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        body_send = scope.get(SERVER_SEND, send)
        pump = asyncio.ensure_future(self._pump(body_send))
        watcher = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait({pump, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, watcher):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump  # its generator is closed: the request is aborted if it still runs
        if pump.cancelled() or pump.exception() is None:
            return
        raise pump.exception()  # type: ignore[misc]

    async def _pump(self, body_send: Any) -> None:
        try:
            async for event in self.events:
                await body_send({"type": "http.response.body", "body": event, "more_body": True})
            await body_send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()


async def _until_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass

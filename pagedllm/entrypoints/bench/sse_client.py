"""A lean HTTP/1.1 client for streamed completions, for the load generators.

A load generator on the same machine as the server competes with it for the cores, so what
the client spends per streamed event is taken from the server being measured. httpx (h11 and
anyio under it) spent about 400 us of CPU per event here, more than the server spent producing
it; a client reading the body off an ``asyncio.StreamReader`` (a ``readline`` and a
``readexactly`` per chunk, each a coroutine that suspends and is woken) still spent 20-30 us.
This one is an ``asyncio.Protocol``: the bytes of a chunk are parsed where they arrive, in
``data_received``, and each event's JSON is handed to a plain callback there, so an event costs
one event-loop callback and no task wake-up. It speaks only what the benchmark needs: plain
``http://``, keep-alive connections reused from a pool, chunked or sized bodies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar
from urllib.parse import urlsplit

T = TypeVar("T")
EventCallback = Callable[[dict[str, Any]], None]


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop where it is installed: the client's own event-loop cost is
    CPU the server on the same machine does not get."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


class StatusError(Exception):
    """The server answered with a status other than 200; ``body`` is what it sent."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.body = body


class _Exchange:
    """One request's answer as it is parsed: head, then body, then done."""

    def __init__(
        self,
        done: asyncio.Future[None],
        on_start: Callable[[], None] | None,
        on_event: EventCallback,
    ) -> None:
        self.done = done
        self.on_start = on_start
        self.on_event = on_event
        self.status = 0
        self.headers: dict[str, str] = {}
        self.chunked = False
        self.remaining = -1  # bytes of a sized body still to come; -1: until the chunk ends
        self.chunk_left = 0  # data bytes of the current chunk still to come
        self.crlf_left = 0  # bytes of the CRLF after the chunk's data still to come
        self.error_body = b""
        self.events = b""  # an SSE event not yet complete
        self.finished_events = False  # [DONE] seen: later data is read and dropped


class _Connection(asyncio.Protocol):
    """A keep-alive connection that parses each answer as its bytes arrive."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.exchange: _Exchange | None = None
        self.buf = b""
        self.closed = False
        self.reusable = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        ex, self.exchange = self.exchange, None
        if ex is not None and not ex.done.done():
            if ex.status and not ex.chunked and ex.remaining < 0:  # a body read until close
                self._finish(ex)
            else:
                ex.done.set_exception(
                    asyncio.IncompleteReadError(self.buf, None)
                    if exc is None
                    else OSError(f"the connection was lost: {exc}")
                )

    def start(self, request: bytes, ex: _Exchange) -> None:
        self.exchange, self.buf, self.reusable = ex, b"", False
        assert self.transport is not None
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        ex = self.exchange
        if ex is None:
            return
        self.buf += data
        try:
            self._parse(ex)
        except Exception as exc:  # a malformed answer, or the caller's callback raised
            self.exchange = None
            if not ex.done.done():
                ex.done.set_exception(exc)
            self.close()

    # -- parsing -------------------------------------------------------------------------------
    def _parse(self, ex: _Exchange) -> None:
        if not ex.status:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            self._head(ex, self.buf[:end].decode("latin-1"))
            self.buf = self.buf[end + 4 :]
        if ex.chunked:
            self._chunks(ex)
        elif ex.remaining >= 0:
            take = self.buf[: ex.remaining]
            self.buf = self.buf[len(take) :]
            ex.remaining -= len(take)
            self._body(ex, take)
            if ex.remaining == 0:
                self._finish(ex)
        else:
            take, self.buf = self.buf, b""
            self._body(ex, take)

    def _head(self, ex: _Exchange, head: str) -> None:
        lines = head.split("\r\n")
        ex.status = int(lines[0].split(" ", 2)[1])
        for line in lines[1:]:
            key, sep, value = line.partition(":")
            if sep:
                ex.headers[key.strip().lower()] = value.strip()
        ex.chunked = ex.headers.get("transfer-encoding", "").lower() == "chunked"
        if not ex.chunked and "content-length" in ex.headers:
            ex.remaining = int(ex.headers["content-length"])
        if ex.status == 200 and ex.on_start is not None:
            ex.on_start()

    def _chunks(self, ex: _Exchange) -> None:
        buf, pos = self.buf, 0
        while True:
            if ex.chunk_left:
                take = buf[pos : pos + ex.chunk_left]
                pos += len(take)
                ex.chunk_left -= len(take)
                self._body(ex, take)
                if ex.chunk_left:
                    break
                ex.crlf_left = 2
            if ex.crlf_left:  # the CRLF that closes a chunk's data, which may arrive split
                n = min(ex.crlf_left, len(buf) - pos)
                pos += n
                ex.crlf_left -= n
                if ex.crlf_left:
                    break
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(buf[pos:eol].split(b";", 1)[0], 16)
            if size == 0:
                end = buf.find(b"\r\n", eol + 2)  # the (empty) trailer section
                if end < 0:
                    break
                self.buf = buf[end + 2 :]
                self._finish(ex)
                return
            pos = eol + 2
            ex.chunk_left = size
        self.buf = buf[pos:]

    def _body(self, ex: _Exchange, data: bytes) -> None:
        if not data:
            return
        if ex.status != 200:
            ex.error_body += data
            return
        if ex.finished_events:
            return
        pending = ex.events + data.replace(b"\r\n", b"\n")
        *complete, ex.events = pending.split(b"\n\n")
        for event in complete:
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    ex.finished_events = True
                    return
                ex.on_event(json.loads(payload))

    def _finish(self, ex: _Exchange) -> None:
        self.exchange = None
        self.reusable = ex.chunked or ex.remaining == 0
        if ex.headers.get("connection", "").lower() == "close":
            self.reusable = False
        if ex.done.done():
            return
        if ex.status != 200:
            ex.done.set_exception(StatusError(ex.status, ex.error_body))
        else:
            ex.done.set_result(None)

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.close()


class StreamClient:
    """POST a JSON body and read the ``data:`` events of the streamed answer."""

    def __init__(
        self, base_url: str, headers: dict[str, str] | None = None, connect_timeout: float = 10
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(
                f"base_url: the streaming client speaks plain http://, got {base_url!r}"
            )
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.connect_timeout = connect_timeout
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head = f"Host: {self.host}:{self.port}\r\nContent-Type: application/json\r\n{extra}"
        self._idle: list[_Connection] = []

    async def _connection(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(
            loop.create_connection(_Connection, self.host, self.port), self.connect_timeout
        )
        return conn

    async def stream(
        self,
        path: str,
        body: dict[str, Any],
        on_event: EventCallback,
        on_start: Callable[[], None] | None = None,
    ) -> None:
        """Send the request; ``on_event`` gets each event's JSON as it arrives, until
        ``[DONE]``; returns when the answer is complete. :class:`StatusError` if it is not a
        200. ``on_start`` is called when a 200 answer's head arrives, before any event. Both
        callbacks run inside the connection's ``data_received``: keep them quick."""
        payload = json.dumps(body).encode()
        request = (
            f"POST {self.prefix}{path} HTTP/1.1\r\n{self._head}"
            f"Content-Length: {len(payload)}\r\n\r\n"
        ).encode() + payload
        conn = await self._connection()
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        conn.start(request, _Exchange(done, on_start, on_event))
        try:
            await done
        except BaseException:
            conn.close()  # cancelled or failed mid-answer: the connection is not clean
            raise
        if conn.reusable and not conn.closed:
            self._idle.append(conn)
        else:
            conn.close()

    async def events(
        self, path: str, body: dict[str, Any], on_start: Callable[[], None] | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """The same events as :meth:`stream`, as an async iterator (one wake-up per event)."""
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        task = asyncio.ensure_future(self.stream(path, body, queue.put_nowait, on_start))
        try:
            while True:
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield getter.result()
                    continue
                getter.cancel()
                while not queue.empty():
                    yield queue.get_nowait()
                task.result()  # raises what the stream raised
                return
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def aclose(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()

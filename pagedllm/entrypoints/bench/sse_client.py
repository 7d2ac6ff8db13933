"""A lean HTTP/1.1 client for streamed completions, for the load generators.

A load generator on the same machine as the server competes with it for the cores, so what
the client spends per streamed event is taken from the server being measured. httpx (h11 and
anyio under it) spent about 400 us of CPU per event here, more than the server spent producing
it; this client reads the chunked body straight off an asyncio stream, splits the server-sent
events and parses each one's JSON, and nothing else. It speaks only what the benchmark needs:
plain ``http://``, keep-alive connections reused from a pool, chunked or sized bodies.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar
from urllib.parse import urlsplit

T = TypeVar("T")


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


_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class StreamClient:
    """POST a JSON body and iterate the ``data:`` events of the streamed answer."""

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
        self._idle: list[_Conn] = []

    async def _connection(self) -> _Conn:
        while self._idle:
            reader, writer = self._idle.pop()
            if not writer.is_closing() and not reader.at_eof():
                return reader, writer
            writer.close()
        return await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port, limit=1 << 20), self.connect_timeout
        )

    async def events(
        self, path: str, body: dict[str, Any], on_start: Callable[[], None] | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Each event's JSON until ``[DONE]``; :class:`StatusError` if the answer is not 200.
        ``on_start`` is called when a 200 answer's head arrives, before any event."""
        payload = json.dumps(body).encode()
        request = (
            f"POST {self.prefix}{path} HTTP/1.1\r\n{self._head}"
            f"Content-Length: {len(payload)}\r\n\r\n"
        ).encode() + payload
        reader, writer = await self._connection()
        reusable = False
        try:
            writer.write(request)
            status, headers = await _read_head(reader)
            if status != 200:
                raise StatusError(status, await _read_body(reader, headers))
            if on_start is not None:
                on_start()
            chunks = _chunks(reader, headers)
            async for event in _sse(chunks):
                yield event
            async for _ in chunks:  # the rest of the body after [DONE], so the connection is clean
                pass
            reusable = headers.get("connection", "").lower() != "close"
        finally:
            if reusable:
                self._idle.append((reader, writer))
            else:
                writer.close()

    async def aclose(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    raw = await reader.readuntil(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
    return status, headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    return b"".join([chunk async for chunk in _chunks(reader, headers)])


async def _chunks(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The body's pieces as they arrive: chunked transfer coding, or a sized body."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";", 1)[0], 16)
            if size == 0:
                await reader.readline()  # the empty trailer section
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        yield await reader.read()


async def _sse(chunks: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
    """Server-sent events' ``data:`` payloads as JSON, ending at ``[DONE]``."""
    pending = b""
    async for chunk in chunks:
        pending += chunk.replace(b"\r\n", b"\n")
        *complete, pending = pending.split(b"\n\n")
        for event in complete:
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                yield json.loads(data)

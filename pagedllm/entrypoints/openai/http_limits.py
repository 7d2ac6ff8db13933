"""The server's HTTP/1.1 protocol: uvicorn's httptools one, with the limits uvicorn lacks.

Why httptools: a streamed token is one chunk written per client, and on a small machine the
server's CPU per chunk is taken from the engine core's step (measured in docs/serving.md).
uvicorn's h11 protocol runs a pure-Python state machine for every chunk it writes; its httptools
protocol frames the chunk in two lines and writes it. The request head is parsed
in C (llhttp) as well.

What uvicorn lacks, added here:

- **A read timeout.** uvicorn closes an idle keep-alive connection only after its first
  response; a socket that connects and sends nothing, half a request head, or half a body is
  held open forever, and a few thousand of them exhaust the server's file descriptors. A timer
  is armed whenever the server waits for the client's bytes, and the connection is closed when
  nothing arrives in time. While a response is being sent (a long stream) it never fires.
- **A bound on the request head** (request line and headers, ``max_head_bytes``): llhttp
  itself accepts headers of any size, so a client could make the server buffer megabytes of
  them. Past the bound the answer is ``431`` and the connection closes.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_431 = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-type: application/json\r\n"
    b"connection: close\r\n"
    b"content-length: %d\r\n\r\n%s"
)
_431_BODY = (
    b'{"error":{"message":"the request head (request line and headers) is too large",'
    b'"type":"invalid_request_error","param":null,"code":"request_header_too_large"}}'
)


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a read timeout and a head-size bound (class
    attributes ``read_timeout`` seconds and ``max_head_bytes``)."""

    read_timeout: float = 10.0
    max_head_bytes: int = 64 * 1024

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._read_timer: asyncio.TimerHandle | None = None
        self._in_head = True  # between requests or inside a head: the client owes us bytes
        self._head_bytes = 0  # bytes received since the current head began
        self._head_size = 0  # the current head's request line and headers, as parsed
        self._rejected = False
        self._arm_read_timer()

    def data_received(self, data: bytes) -> None:
        if self._rejected:
            return
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        # Still inside the same head after all of it was read (a head that completes within
        # this data is measured by its parts in on_headers_complete).
        if self._in_head and self._head_bytes > self.max_head_bytes and not self._rejected:
            self._reject_head()
            return
        if not self.transport.is_closing():
            self._arm_read_timer()

    # -- the head ------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_size = 0

    def on_url(self, url: bytes) -> None:
        self._head_size += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + 4
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        if self._head_size > self.max_head_bytes:
            self._reject_head()
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._rejected:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._rejected:
            return
        super().on_message_complete()
        self._in_head = True  # the next request (keep-alive or pipelined) starts here

    def _reject_head(self) -> None:
        self._rejected = True
        self.transport.write(_431 % (len(_431_BODY), _431_BODY))
        self.transport.close()

    # -- the read timer ------------------------------------------------------------------------
    def connection_lost(self, exc: Exception | None) -> None:
        timer = getattr(self, "_read_timer", None)
        if timer is not None:
            timer.cancel()
            self._read_timer = None
        super().connection_lost(exc)

    def _arm_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer = self.loop.call_later(self.read_timeout, self._on_read_timeout)

    def _waiting_for_client(self) -> bool:
        """No request yet or half its head, or half a body: the client owes us bytes. An idle
        keep-alive connection after a complete response is uvicorn's keep-alive timer's."""
        cycle = self.cycle
        if cycle is None:
            return True
        if self._in_head:
            return cycle.response_complete and self._head_bytes > 0
        return cycle.more_body and not cycle.response_complete

    def _on_read_timeout(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if self._waiting_for_client():
            self.transport.close()
        else:
            self._arm_read_timer()


def limited_protocol(read_timeout: float, max_head_bytes: int) -> type[Any]:
    """A protocol class for ``uvicorn.Config(http=...)`` with these limits."""
    return type(
        "LimitedHttpToolsProtocol",
        (LimitedHttpToolsProtocol,),
        {"read_timeout": float(read_timeout), "max_head_bytes": int(max_head_bytes)},
    )

"""Connection limits uvicorn does not have: a client that stalls while sending is cut off.

uvicorn closes an idle keep-alive connection only after its first response; a socket that
connects and sends nothing, half a request line, or half a body, is held open forever, and a
few thousand of them exhaust the server's file descriptors. :class:`TimedH11Protocol` arms a
read timer whenever the server waits for the client's bytes and closes the connection when
nothing arrives in time. While a response is being sent (a long stream) the timer never fires.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a read timeout (``read_timeout`` seconds, class attribute)."""

    read_timeout: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._read_timer: asyncio.TimerHandle | None = None
        self._arm_read_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._arm_read_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        timer = getattr(self, "_read_timer", None)
        if timer is not None:
            timer.cancel()
        super().connection_lost(exc)

    def _arm_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer = self.loop.call_later(self.read_timeout, self._on_read_timeout)

    def _waiting_for_client(self) -> bool:
        # IDLE: no request yet (or half its head); SEND_BODY: half a body.
        return self.conn.their_state in (h11.IDLE, h11.SEND_BODY)

    def _on_read_timeout(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        responding = self.cycle is not None and not self.cycle.response_complete
        if self._waiting_for_client() and not (responding and self.conn.their_state == h11.IDLE):
            self.transport.close()
        else:
            self._arm_read_timer()


def timed_protocol(read_timeout: float) -> type[Any]:
    """A protocol class for ``uvicorn.Config(http=...)`` with this read timeout."""
    return type("TimedH11Protocol", (TimedH11Protocol,), {"read_timeout": float(read_timeout)})

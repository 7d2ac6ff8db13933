"""The asyncio side of running requests: engine failures as HTTP errors, a client that goes
away, and several requests' outputs merged into one stream.

Kept apart from the validation in ``serving_base.py``: these never look at a request's fields,
only at its streams and its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any, TypeVar

from fastapi import Request

from pagedllm.engine.client import EngineDeadError, EngineStepError, RequestStream
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.outputs import RequestOutput

T = TypeVar("T")


class ClientDisconnected(APIError):
    def __init__(self) -> None:
        super().__init__("client disconnected", status=499, code="client_closed_request")


@contextlib.contextmanager
def engine_errors() -> Iterator[None]:
    """Engine failures are the server's fault: 500 for a failed step, 503 when it is gone."""
    try:
        yield
    except EngineStepError as exc:
        raise APIError(str(exc), status=500, type="internal_server_error") from exc
    except EngineDeadError as exc:
        raise APIError(str(exc), status=503, type="service_unavailable") from exc


def error_event(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(str(exc), status=503, type="service_unavailable")
    return APIError(f"{type(exc).__name__}: {exc}", status=500, type="internal_server_error")


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """Mark a cancelled gather's outcome as seen, so asyncio does not log it."""
    if not fut.cancelled():
        fut.exception()


async def until_disconnected(request: Request | None, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` unless the client goes away first (then cancel it)."""
    task = asyncio.ensure_future(awaitable)
    if request is None:
        return await task
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            task.add_done_callback(_retrieve)
    if task in done:
        return task.result()
    raise ClientDisconnected()


async def last_output(stream: RequestStream, first: RequestOutput) -> RequestOutput:
    last = first
    async for out in stream:  # outputs are cumulative: only the final one matters
        last = out
    return last


async def merge_streams(
    pairs: list[tuple[RequestStream, RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come: ``(prompt index, output)``."""
    if len(pairs) == 1:
        stream, first = pairs[0]
        yield 0, first
        async for out in stream:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream, first: RequestOutput) -> None:
        await queue.put((index, first))
        try:
            async for out in stream:
                await queue.put((index, out))
        except Exception as exc:
            await queue.put((index, exc))
        await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, s, f)) for i, (s, f) in enumerate(pairs)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def arrival_time(request: Request | None) -> float | None:
    """When the HTTP request came in (stamped by ``sse.ServerApp`` as it enters the app): where
    TTFT and latency metrics start."""
    return getattr(request.state, "arrival_time", None) if request is not None else None

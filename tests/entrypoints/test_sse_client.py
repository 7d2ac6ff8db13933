"""The load generator's streaming client against a hand-written HTTP/1.1 server: events split
across chunks, keep-alive reuse, sized error bodies."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagedllm.entrypoints.bench.sse_client import StatusError, StreamClient


def _chunked(pieces: list[bytes]) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
    return body + b"0\r\n\r\n"


async def _serve(answers: list[bytes], seen: list[bytes]) -> tuple[asyncio.Server, int]:
    """Answer each request on a connection with the next of ``answers``; count connections."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(b"connection")
        while answers:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            seen.append(await reader.readexactly(length))
            writer.write(answers.pop(0))
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_events_split_across_chunks_and_connection_reuse() -> None:
    events = [{"choices": [{"text": t}]} for t in ("a", "b\n", "c")]
    sse = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    sse += b"data: [DONE]\n\n"
    ok = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    # The same stream cut at every few bytes, then whole; then an error with a sized body.
    cut = [sse[i : i + 7] for i in range(0, len(sse), 7)]
    error = b'{"error": {"message": "bad"}}'
    answers = [
        ok + _chunked(cut),
        ok + _chunked([sse]),
        b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(error), error),
    ]
    seen: list[bytes] = []

    async def main() -> tuple[list[list[dict]], StatusError]:
        server, port = await _serve(answers, seen)
        client = StreamClient(f"http://127.0.0.1:{port}", {"Authorization": "Bearer k"})
        got, started = [], []
        for _ in range(2):
            got.append(
                [e async for e in client.events("/v1/x", {"n": 1}, lambda: started.append(1))]
            )
        with pytest.raises(StatusError) as info:
            async for _ in client.events("/v1/x", {"n": 2}):
                pass
        await client.aclose()
        server.close()
        assert started == [1, 1]
        return got, info.value

    got, err = asyncio.run(main())
    assert got == [events, events]
    assert err.status == 400 and json.loads(err.body) == json.loads(error)
    assert seen.count(b"connection") == 1  # one keep-alive connection served all three
    assert [json.loads(b) for b in seen if b != b"connection"] == [{"n": 1}, {"n": 1}, {"n": 2}]


def test_only_plain_http() -> None:
    with pytest.raises(ValueError, match="base_url"):
        StreamClient("https://example.com")


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        self.closed = True


def _feed(answer: bytes, step: int) -> tuple[list[dict], BaseException | None, bool, list[int]]:
    """``answer`` handed to the protocol ``step`` bytes at a time; the events it reported,
    what the exchange ended with, whether the connection may be reused, and the order of the
    start callback among the events."""
    from pagedllm.entrypoints.bench.sse_client import _Connection, _Exchange

    async def main() -> tuple[list[dict], BaseException | None, bool, list[int]]:
        conn, events, order = _Connection(), [], []
        conn.connection_made(_Transport())  # type: ignore[arg-type]
        done = asyncio.get_running_loop().create_future()
        conn.start(
            b"POST / HTTP/1.1\r\n\r\n",
            _Exchange(done, lambda: order.append(len(events)), events.append),
        )
        for i in range(0, len(answer), step):
            conn.data_received(answer[i : i + step])
        if not done.done():
            conn.connection_lost(None)
        return events, done.exception(), conn.reusable, order

    return asyncio.run(main())


@pytest.mark.parametrize("step", [1, 2, 3, 5, 64, 10_000])
def test_the_parser_takes_an_answer_cut_anywhere(step: int) -> None:
    """Chunk-size lines, chunk data, the CRLF after it and the trailer may each arrive in
    pieces; events may span chunks; what follows [DONE] is read and dropped."""
    events = [{"choices": [{"text": t}]} for t in ("a", "b\n\nc", "é")]
    sse = b"".join(b"data: " + json.dumps(e).encode() + b"\r\n\r\n" for e in events)
    sse += b"data: [DONE]\n\n"
    pieces = [sse[:10], sse[10:11], sse[11:40], sse[40:], b": trailing comment\n\n"]
    ok = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    got, error, reusable, order = _feed(ok + _chunked(pieces), step)
    assert error is None and got == events and reusable and order == [0]


@pytest.mark.parametrize("step", [1, 7, 10_000])
def test_the_parser_reads_sized_bodies_and_errors(step: int) -> None:
    sse = b'data: {"x": 1}\n\ndata: [DONE]\n\n'
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(sse), sse)
    got, error, reusable, _ = _feed(ok, step)
    assert error is None and got == [{"x": 1}] and reusable
    body = b'{"error": {"message": "no"}}'
    bad = b"HTTP/1.1 429 Too Many\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (
        len(body),
        body,
    )
    got, error, reusable, order = _feed(bad, step)
    assert isinstance(error, StatusError) and error.status == 429 and error.body == body
    assert got == [] and order == [] and not reusable


def test_the_parser_reports_a_connection_lost_mid_body() -> None:
    ok = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    got, error, reusable, _ = _feed(ok + b'10\r\ndata: {"x": 1}\n\n\r\n5\r\nda', 3)
    assert got == [{"x": 1}]
    assert isinstance(error, asyncio.IncompleteReadError) and not reusable

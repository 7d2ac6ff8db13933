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

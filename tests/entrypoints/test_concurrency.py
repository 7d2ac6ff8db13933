"""Many clients at once: streams that finish, streams the client drops, and a responsive server.

Every request must end (finished or aborted), and once the engine is idle every KV block must be
free again: a client that disconnects mid-stream must not leak its blocks.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from typing import Any

import httpx
import openai

from tests.entrypoints.conftest import API_KEY, MAX_MODEL_LEN, MODEL_NAME, stall_core

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Paged attention keeps",
    "你好",
    "import os",
    "Continuous batching",
    "A",
    "Emoji: 🚀",
]
NUM_REQUESTS = 32
MAX_TOKENS = 24


def finish_counts(server: Any) -> dict[str, float]:
    """``pagedllm:request_success_total`` by finish reason, read from /metrics."""
    text = httpx.get(server.base_url + "/metrics").text
    prefix = 'pagedllm:request_success_total{finished_reason="'
    counts = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            label, _, value = line[len(prefix) :].partition('"} ')
            counts[label] = float(value)
    return counts


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def ended_since(server: Any, before: dict[str, float], total: int) -> dict[str, float]:
    """Finish reasons counted since ``before``, once ``total`` requests are counted (5 s at most).

    A request is counted by the server's receiving thread when its final output arrives, just
    after the request leaves the table of requests in flight that ``wait_idle`` polls, so a
    read of /metrics straight after ``wait_idle`` can miss the last few (seen for aborts).
    """
    deadline = time.monotonic() + 5.0
    while True:
        ended = _delta(finish_counts(server), before)
        if sum(ended.values()) >= total or time.monotonic() > deadline:
            return ended
        time.sleep(0.02)


class HealthProbe(threading.Thread):
    """GET /health from its own thread while the engine is busy; records each latency."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.latencies: list[float] = []
        self.statuses: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=5) as c:
            c.get("/health")  # connect once; latencies are per request
            while not self.stop.is_set():
                t0 = time.perf_counter()
                r = c.get("/health")
                self.latencies.append(time.perf_counter() - t0)
                self.statuses.append(r.status_code)
                self.stop.wait(0.05)


async def _one(client: openai.AsyncOpenAI, i: int, cancel: bool) -> dict[str, Any]:
    # A stream that will be cancelled asks for far more tokens than the others (a one-token
    # prompt keeps it inside max_model_len), so it cannot finish before its disconnect is seen.
    stream = await client.completions.create(
        model=MODEL_NAME,
        prompt="A" if cancel else PROMPTS[i % len(PROMPTS)],
        max_tokens=MAX_MODEL_LEN - 16 if cancel else MAX_TOKENS,
        temperature=0 if i % 2 else 0.9,
        seed=i,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, finish, usage, chunks = "", None, None, 0
    async with stream:
        async for chunk in stream:
            chunks += 1
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
            if cancel and chunks >= 2:
                break  # leaving the context manager closes the connection mid-stream
    return {"cancelled": cancel, "text": text, "finish": finish, "usage": usage}


def test_32_streams_some_cancelled_free_every_block(server: Any) -> None:
    probe = HealthProbe(server.base_url)
    saw_busy = threading.Event()

    def watch() -> None:
        while not probe.stop.is_set():
            if server.stats()["num_requests_running"] > 0:
                saw_busy.set()
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)

    async def main() -> list[dict[str, Any]]:
        client = openai.AsyncOpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=60)
        async with client:
            return await asyncio.gather(
                *(_one(client, i, cancel=i % 4 == 3) for i in range(NUM_REQUESTS))
            )

    before = finish_counts(server)
    watcher.start()
    probe.start()
    try:
        results = asyncio.run(asyncio.wait_for(main(), timeout=90))
    finally:
        probe.stop.set()
        probe.join(10)
        watcher.join(10)
    done = [r for r in results if not r["cancelled"]]
    assert len(done) == 24 and len(results) == NUM_REQUESTS
    for r in done:
        assert r["finish"] == "length", r
        assert r["usage"].completion_tokens == MAX_TOKENS, r
    server.assert_all_blocks_free()
    ended = ended_since(server, before, NUM_REQUESTS)
    print(f"finish reasons of the {NUM_REQUESTS} requests: {ended}")
    assert ended == {"length": 24, "abort": 8}, ended
    assert saw_busy.is_set()
    assert probe.statuses and set(probe.statuses) == {200}
    worst, median = max(probe.latencies), statistics.median(probe.latencies)
    print(
        f"/health while busy: {len(probe.latencies)} probes, median {median * 1e3:.1f} ms, "
        f"max {worst * 1e3:.1f} ms"
    )
    assert median < 0.2, f"/health median {median * 1e3:.0f} ms while busy"
    # One slow outlier on a loaded 2-core machine is tolerated, a pattern is not.
    slow = [t for t in probe.latencies if t >= 0.2]
    assert len(slow) <= max(1, len(probe.latencies) // 10), probe.latencies


def test_client_timeout_on_non_streaming_request_aborts_it(server: Any) -> None:
    body = {
        "model": MODEL_NAME,
        "prompt": "The quick brown fox",
        "max_tokens": 120,
        "temperature": 0,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    before = finish_counts(server)
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=0.1) as c:
        try:
            c.post("/v1/completions", json=body)
            timed_out = False
        except httpx.TimeoutException:
            timed_out = True
    server.assert_all_blocks_free()
    ended = ended_since(server, before, 1)
    assert ended == ({"abort": 1} if timed_out else {"length": 1}), ended


def test_cancel_while_waiting_for_first_token(server: Any) -> None:
    """Clients that leave before their first token (the engine is stalled) are aborted too."""

    async def main() -> None:
        client = openai.AsyncOpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=60)
        async with client:
            # Hold the engine thread so the requests queue up without any output.
            stall = asyncio.create_task(server.engine.call(stall_core, 0.6))
            await asyncio.sleep(0.05)
            tasks = [asyncio.create_task(_one(client, i, cancel=False)) for i in range(8)]
            await asyncio.sleep(0.3)
            for t in tasks[4:]:
                t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            await stall
        finished = [r for r in results if isinstance(r, dict)]
        assert len(finished) == 4 and all(r["finish"] == "length" for r in finished)

    before = finish_counts(server)
    asyncio.run(asyncio.wait_for(main(), timeout=60))
    server.assert_all_blocks_free()
    ended = ended_since(server, before, 8)
    assert ended == {"length": 4, "abort": 4}, ended

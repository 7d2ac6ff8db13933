"""AsyncEngine: threading, streaming, errors, cancellation and shutdown.

Most tests drive a scripted stand-in for LLMEngine (one token per request per step) so the
threading logic is checked exactly and fast; the last ones use the real tiny-model engine behind
the test server and check that KV blocks come back.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from pagedllm import SamplingParams
from pagedllm.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineStepError,
    StatLogger,
)
from pagedllm.outputs import CompletionOutput, RequestOutput


def _output(rid: str, n: int, reason: str | None) -> RequestOutput:
    return RequestOutput(
        request_id=rid,
        prompt=None,
        prompt_token_ids=[1],
        outputs=[CompletionOutput(0, "x" * n, list(range(n)), finish_reason=reason)],
        finished=reason is not None,
    )


class FakeEngine:
    """LLMEngine's surface as AsyncEngine uses it; one token per running request per step."""

    def __init__(self, step_s: float = 0.001) -> None:
        self.tokenizer = None
        self.step_s = step_s
        self.requests: dict[str, list[int]] = {}  # id -> [generated, max_tokens]
        self.pending: list[RequestOutput] = []
        self.fail_steps = 0
        self.step_threads: set[str] = set()
        self.aborted: list[str] = []
        self.shut_down = False

    def add_request(
        self,
        rid: str,
        prompt: Any,
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        if rid in self.requests:
            raise ValueError(f"request_id: {rid!r} is already in use")
        if prompt == "bad":
            raise ValueError("prompt: must not be bad")
        self.requests[rid] = [0, params.max_tokens or 16]

    def abort_request(self, ids: str | list[str]) -> None:
        for rid in [ids] if isinstance(ids, str) else ids:
            if self.requests.pop(rid, None) is not None:
                self.aborted.append(rid)
                self.pending.append(_output(rid, 0, "abort"))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self.pending)

    def step(self) -> list[RequestOutput]:
        self.step_threads.add(threading.current_thread().name)
        time.sleep(self.step_s)
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("injected step failure")
        outs, self.pending = self.pending, []
        for rid, state in list(self.requests.items()):
            state[0] += 1
            done = state[0] >= state[1]
            outs.append(_output(rid, state[0], "length" if done else None))
            if done:
                del self.requests[rid]
        return outs

    def get_stats(self) -> dict[str, float]:
        return {
            "num_requests_running": len(self.requests),
            "num_requests_waiting": 0,
            "num_requests_swapped": 0,
            "kv_cache_usage_perc": 0.0,
            "prompt_tokens_total": 0,
            "generation_tokens_total": 0,
        }

    def shutdown(self) -> None:
        self.shut_down = True


def _run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=20))


async def _collect(
    engine: AsyncEngine, prompt: Any, max_tokens: int, rid: str
) -> list[RequestOutput]:
    return [o async for o in engine.generate(prompt, SamplingParams(max_tokens=max_tokens), rid)]


def test_streams_until_finished_on_the_engine_thread() -> None:
    fake = FakeEngine()
    engine = AsyncEngine(fake, log_stats_interval=None)

    async def main() -> None:
        a, b = await asyncio.gather(_collect(engine, "p", 5, "a"), _collect(engine, "q", 9, "b"))
        for outs, n in ((a, 5), (b, 9)):
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
            assert len(outs[-1].outputs[0].token_ids) == n
            assert not any(o.finished for o in outs[:-1])
        name = await engine.call(lambda e: threading.current_thread().name)
        assert name == "pagedllm-engine"

    _run(main())
    assert fake.step_threads == {"pagedllm-engine"}
    engine.stop()
    assert fake.shut_down


def test_add_request_error_raises_before_any_output() -> None:
    engine = AsyncEngine(FakeEngine(), log_stats_interval=None)

    async def main() -> None:
        gen = engine.generate("bad", SamplingParams(), "r1")
        with pytest.raises(ValueError, match="^prompt: must not be bad"):
            await gen.__anext__()
        with pytest.raises(ValueError, match="^prompt"):
            await engine.add_request("r2", "bad", SamplingParams())
        # A duplicate id is refused while the first request runs.
        stream = await engine.add_request("dup", "p", SamplingParams(max_tokens=10_000))
        with pytest.raises(ValueError, match="^request_id"):
            await engine.add_request("dup", "p", SamplingParams())
        stream.abort()

    _run(main())
    engine.stop()


def test_cancelling_the_consumer_aborts_the_request() -> None:
    fake = FakeEngine()
    engine = AsyncEngine(fake, log_stats_interval=None)

    async def main() -> None:
        seen = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate("p", SamplingParams(max_tokens=1_000_000), "long"):
                seen.set()

        task = asyncio.create_task(consume())
        await seen.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(500):
            if engine.num_in_flight == 0 and not fake.requests:
                break
            await asyncio.sleep(0.01)
        assert fake.aborted == ["long"] and not fake.requests and engine.num_in_flight == 0

    _run(main())
    engine.stop()


def test_slow_consumer_skips_to_the_newest_output() -> None:
    engine = AsyncEngine(FakeEngine(step_s=0.0), log_stats_interval=None)

    async def main() -> None:
        stream = await engine.add_request("r", "p", SamplingParams(max_tokens=200))
        await asyncio.sleep(0.3)  # let many steps pile up
        outs = [o async for o in stream]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 200
        assert len(outs) < 200, "queued cumulative outputs were not coalesced"

    _run(main())
    engine.stop()


def test_step_failure_fails_in_flight_requests_then_keeps_serving() -> None:
    fake = FakeEngine(step_s=0.002)
    engine = AsyncEngine(fake, log_stats_interval=None)

    async def main() -> None:
        stream = await engine.add_request("victim", "p", SamplingParams(max_tokens=10_000))
        await stream.__anext__()
        fake.fail_steps = 1
        with pytest.raises(EngineStepError, match="injected step failure"):
            async for _ in stream:
                pass
        assert engine.is_healthy
        assert "victim" in fake.aborted  # dropped from the engine, so its blocks are freed
        outs = await _collect(engine, "p", 3, "after")
        assert outs[-1].outputs[0].finish_reason == "length"

    _run(main())
    engine.stop()


def test_repeated_step_failures_mark_the_engine_dead() -> None:
    fake = FakeEngine()
    engine = AsyncEngine(fake, log_stats_interval=None)

    async def main() -> None:
        fake.fail_steps = 100
        with pytest.raises(EngineStepError):
            await _collect(engine, "p", 5, "r0")
        for i in range(1, 3):  # failures count per step: the engine may be dead already
            with pytest.raises((EngineStepError, EngineDeadError)):
                await _collect(engine, "p", 5, f"r{i}")
        for _ in range(200):
            if not engine.is_healthy:
                break
            await asyncio.sleep(0.01)
        assert not engine.is_healthy
        with pytest.raises(EngineDeadError):
            await engine.add_request("late", "p", SamplingParams())

    _run(main())
    engine.stop()


def test_shutdown_lets_short_requests_finish_and_aborts_the_rest() -> None:
    fake = FakeEngine(step_s=0.002)
    engine = AsyncEngine(fake, log_stats_interval=None)

    async def main() -> None:
        short = asyncio.create_task(_collect(engine, "p", 20, "short"))
        long = asyncio.create_task(_collect(engine, "p", 1_000_000, "long"))
        await asyncio.sleep(0.02)
        t0 = time.monotonic()
        await engine.shutdown(timeout=0.5)
        assert time.monotonic() - t0 < 5
        assert (await short)[-1].outputs[0].finish_reason == "length"
        assert (await long)[-1].outputs[0].finish_reason == "abort"
        with pytest.raises(EngineDeadError):
            await engine.add_request("late", "p", SamplingParams())

    _run(main())
    assert fake.shut_down and not fake.requests


def test_stat_logger_reports_throughput_while_busy() -> None:
    stats = {
        "prompt_tokens_total": 0,
        "generation_tokens_total": 0,
        "num_requests_running": 0,
        "num_requests_waiting": 0,
        "num_requests_swapped": 0,
        "kv_cache_usage_perc": 0.0,
    }
    log = StatLogger(interval=5.0, last_time=100.0)
    assert log.maybe_log(stats, now=103.0) is None  # too soon
    assert log.maybe_log(stats, now=105.0) is None  # idle: nothing to say
    busy = {
        **stats,
        "prompt_tokens_total": 500,
        "generation_tokens_total": 100,
        "num_requests_running": 3,
        "num_requests_waiting": 2,
        "kv_cache_usage_perc": 0.25,
    }
    line = log.maybe_log(busy, now=110.0)
    assert line is not None
    assert "Avg prompt throughput: 100.0 tokens/s" in line
    assert "Avg generation throughput: 20.0 tokens/s" in line
    assert "Running: 3 reqs" in line and "Pending: 2 reqs" in line
    assert "KV cache usage: 25.0%" in line


# -- the real engine -------------------------------------------------------------------------


def test_real_engine_matches_offline_generate_and_frees_blocks(server: Any) -> None:
    prompts = ["The quick brown fox", "Paged attention", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = server.offline(prompts, params)

    async def main() -> list[RequestOutput]:
        async def last(i: int, p: str) -> RequestOutput:
            outs = [o async for o in server.engine.generate(p, params, f"ae-{i}")]
            return outs[-1]

        return await asyncio.gather(*(last(i, p) for i, p in enumerate(prompts)))

    got = _run(main())
    for g, e in zip(got, expected, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert g.outputs[0].text == e.outputs[0].text
    server.assert_all_blocks_free()


def test_real_engine_cancel_mid_stream_frees_blocks(server: Any) -> None:
    async def main() -> None:
        params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        gen = server.engine.generate("The quick brown fox", params, "ae-cancel")
        first = await gen.__anext__()
        assert not first.finished
        await gen.aclose()

    _run(main())
    server.assert_all_blocks_free()

"""The engine core in its own process: its death is seen at once, big prompts never stall the loop.

The bounded budgets here (1 s to notice a dead core, 100 ms for /health while a huge prompt is
handled) are the promises of issue 16, with room: each measured value is far below them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from typing import Any

import httpx
import pytest

from pagedllm.core.sampling_params import SamplingParams
from tests.entrypoints.conftest import API_KEY, MODEL_NAME, small_core_client, start_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _stream_one(
    base: str, headers: dict[str, str], max_tokens: int = 8, started: threading.Event | None = None
) -> dict[str, Any]:
    """A streaming completion: time to its first event, the largest gap, and its events."""
    body = {
        "model": MODEL_NAME,
        "prompt": "The quick brown fox",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.monotonic()
    events, gaps, first = [], [], None
    with httpx.stream(
        "POST", base + "/v1/completions", json=body, headers=headers, timeout=60
    ) as r:
        last = start
        for line in r.iter_lines():
            if line.startswith("data: "):
                now = time.monotonic()
                first = now - start if first is None else first
                gaps.append(now - last)
                last = now
                events.append(line[6:])
                if started is not None:
                    started.set()
    return {
        "status": r.status_code,
        "first": first,
        "max_gap": max(gaps, default=None),
        "events": events,
    }


def test_a_server_that_cannot_be_built_stops_the_core(
    llama_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure between the core's start and serving must not leave the core running: the
    process would hold the model's memory and keep `pagedllm serve` from exiting."""
    from pagedllm.engine.core_client import EngineCoreClient
    from pagedllm.entrypoints.openai import api_server

    engine = EngineCoreClient.from_engine_args(
        str(llama_path), "cpu", dtype="float32", num_kv_blocks=16, block_size=8,
        max_model_len=64, log_stats_interval=None,
    )  # fmt: skip
    assert engine.proc.is_alive()

    def broken_app(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no app today")

    monkeypatch.setattr(api_server, "build_app", broken_app)
    info = api_server.model_info(engine, [MODEL_NAME])
    with pytest.raises(RuntimeError, match="no app today"):
        api_server.run_server(engine, info, api_server.ServerSettings(), port=1)
    assert not engine.proc.is_alive()


def test_killing_the_core_gives_503_within_a_second_and_a_nonzero_exit(llama_path: Any) -> None:
    from pagedllm.entrypoints.openai.api_server import ServerSettings, model_info, run_server
    from tests.entrypoints.conftest import free_port

    engine = small_core_client(llama_path)
    port, result = free_port(), {}
    thread = threading.Thread(
        target=lambda: result.update(
            status=run_server(
                engine,
                model_info(engine, [MODEL_NAME]),
                ServerSettings(),
                port=port,
                log_level="warning",
            )
        ),
        daemon=True,
    )
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(base + "/health").status_code == 200:
                break
        except httpx.ConnectError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.05)
    streamed: dict[str, Any] = {}
    started = threading.Event()
    long_stream = threading.Thread(
        target=lambda: streamed.update(_stream_one(base, {}, 100, started)), daemon=True
    )
    long_stream.start()
    assert started.wait(60), "the stream never started"
    os.kill(engine.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    while httpx.get(base + "/health").status_code != 503:
        assert time.monotonic() - killed < 1.0, "/health still 200 a second after the core died"
        time.sleep(0.02)
    assert time.monotonic() - killed < 1.0
    long_stream.join(30)
    assert not long_stream.is_alive(), "a stream hangs after the core died"
    assert streamed["events"][-1] == "[DONE]"
    assert "error" in json.loads(streamed["events"][-2])
    thread.join(30)
    assert not thread.is_alive(), "the server did not exit after the core died"
    assert result == {"status": 1}


# /health measures the event loop alone and gets the 100 ms budget. A stream's first token also
# needs CPU for the core's step, which on this shared 2-core machine (load ~10) competes with the
# tokenizer thread: it gets the budget on top of its own time measured alone, plus CPU slack.
_STREAM_SLACK_S = 0.4


def _health_noise(base: str) -> float:
    """The slowest of 20 /health calls with nothing else going on, beyond the budget's 100 ms.

    Zero on a quiet machine; on a loaded one (five jobs on two cores) this test process itself
    may wait its turn for a CPU, which no server design can remove.
    """
    with httpx.Client(base_url=base, timeout=30) as c:
        c.get("/health")
        times = []
        for _ in range(20):
            start = time.monotonic()
            c.get("/health")
            times.append(time.monotonic() - start)
    return max(0.0, max(times) - 0.02)


def _baseline(base: str) -> float:
    """The best time to a streaming request's first event with nothing else going on.

    That time is mostly the engine core's step, which on a shared 2-core machine can itself take
    tens of milliseconds; the promise is about what a big request adds to it.
    """
    return min(_stream_one(base, AUTH)["first"] for _ in range(3))


def _responsive_while(base: str, job: Any) -> tuple[float, dict[str, Any], Any]:
    """Run ``job`` in a thread; meanwhile the slowest /health and one streaming request."""
    outcome: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: outcome.update(result=job()), daemon=True)
    with httpx.Client(base_url=base, headers=AUTH, timeout=30) as c:
        c.get("/health")  # warm connection
        worker.start()
        time.sleep(0.02)
        worst = 0.0
        stream = None
        while worker.is_alive():
            start = time.monotonic()
            assert c.get("/health").status_code == 200
            worst = max(worst, time.monotonic() - start)
            if stream is None:
                stream = _stream_one(base, AUTH)
            time.sleep(0.01)
    worker.join()
    return worst, stream or _stream_one(base, AUTH), outcome["result"]


@pytest.fixture(scope="module")
def big_body_server(server: Any) -> Any:
    """The test engine behind an app with the default limits (a 32 MB body is read)."""
    from pagedllm.entrypoints.openai.api_server import ServerSettings, build_app, model_info

    app = build_app(
        server.engine,
        model_info(server.engine, [MODEL_NAME]),
        ServerSettings(api_key=API_KEY),
        owns_engine=False,
    )
    srv, thread, port = start_server(app)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)


def _over_budget(worst: float, noise: float, stream: dict[str, Any], alone: float) -> str | None:
    if worst >= 0.1 + noise:
        return f"/health took {worst * 1e3:.0f} ms (noise {noise * 1e3:.0f} ms)"
    if stream["first"] >= alone + _STREAM_SLACK_S:
        return f"first stream event after {stream['first'] * 1e3:.0f} ms (alone {alone * 1e3:.0f})"
    return None


def _within_budget(attempt: Any, tries: int = 3) -> None:
    """Pass when one of ``tries`` attempts keeps the budget. A loop that is blocked (a 30 MB
    prompt froze it for 19 s) misses it every time; a machine shared by five jobs on two cores
    sometimes delays one request of one attempt."""
    misses = []
    for _ in range(tries):
        miss = attempt()
        if miss is None:
            return
        misses.append(miss)
    raise AssertionError("; ".join(misses))


def _post_from_another_process(url: str, body: bytes, tmp_path: Any) -> tuple[int, Any]:
    """POST with curl: a 30 MB upload from this process would compete with the server (which
    runs on a thread here) for the GIL, and that is not what is being measured."""
    import subprocess

    path = tmp_path / "body.json"
    path.write_bytes(body)
    done = subprocess.run(
        [
            "curl",
            "-s",
            "-o",
            str(tmp_path / "out.json"),
            "-w",
            "%{http_code}",
            "-H",
            f"Authorization: Bearer {API_KEY}",
            "-H",
            "Content-Type: application/json",
            "--data-binary",
            f"@{path}",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return int(done.stdout), json.loads((tmp_path / "out.json").read_text())


def test_a_30mb_prompt_is_refused_while_health_and_streams_answer(
    big_body_server: str, tmp_path: Any
) -> None:
    import shutil

    if shutil.which("curl") is None:
        pytest.skip("needs curl (the upload must come from another process)")
    base = big_body_server
    body = json.dumps({"model": MODEL_NAME, "prompt": "x" * (30 << 20), "max_tokens": 1}).encode()

    def attempt() -> str | None:
        alone, noise = _baseline(base), _health_noise(base)
        worst, stream, (status, response) = _responsive_while(
            base, lambda: _post_from_another_process(base + "/v1/completions", body, tmp_path)
        )
        assert status == 413, response
        assert response["error"]["code"] == "prompt_too_large"
        assert stream["status"] == 200 and stream["events"][-1] == "[DONE]", stream
        return _over_budget(worst, noise, stream, alone)

    _within_budget(attempt)


def test_a_prompt_at_the_limit_is_tokenized_off_the_loop(big_body_server: str) -> None:
    from pagedllm.entrypoints.openai.offload import RequestLimits

    base = big_body_server
    words = "hello world the quick brown fox "
    limit = RequestLimits().max_prompt_chars
    text = (words * (limit // len(words) + 1))[:limit]

    body = json.dumps({"prompt": text}).encode()
    headers = {**AUTH, "Content-Type": "application/json"}

    def tokenize() -> httpx.Response:
        return httpx.post(base + "/tokenize", headers=headers, timeout=120, content=body)

    def attempt() -> str | None:
        alone, noise = _baseline(base), _health_noise(base)
        worst, stream, response = _responsive_while(base, tokenize)
        assert response.status_code == 200 and response.json()["count"] > 1000
        assert stream["status"] == 200 and stream["events"][-1] == "[DONE]", stream
        return _over_budget(worst, noise, stream, alone)

    _within_budget(attempt)
    over = httpx.post(base + "/tokenize", headers=AUTH, json={"prompt": text + "x"})
    assert over.status_code == 413 and over.json()["error"]["param"] == "prompt"


def test_detokenize_and_token_prompts_have_limits(big_body_server: str) -> None:
    from pagedllm.entrypoints.openai.offload import RequestLimits

    limits = RequestLimits()
    base = big_body_server
    r = httpx.post(
        base + "/detokenize",
        headers=AUTH,
        json={"tokens": [5] * (limits.max_detokenize_tokens + 1)},
    )
    assert r.status_code == 413 and r.json()["error"]["param"] == "tokens"
    r = httpx.post(
        base + "/v1/completions",
        headers=AUTH,
        timeout=60,
        json={"model": MODEL_NAME, "prompt": [5] * (limits.max_prompt_tokens + 1)},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_large"
    r = httpx.post(base + "/detokenize", headers=AUTH, json={"tokens": [5, 6, 7]})
    assert r.status_code == 200 and isinstance(r.json()["prompt"], str)


def test_split_metrics_are_exported(server: Any, http: Any) -> None:
    r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200
    text = http.get("/metrics").text
    for name in ("server_queue_time_seconds", "core_queue_time_seconds", "step_time_seconds"):
        count = [line for line in text.splitlines() if line.startswith(f"pagedllm:{name}_count")]
        assert count and float(count[0].split()[-1]) > 0, name


@dataclasses.dataclass
class _Extended(SamplingParams):
    """SamplingParams as another part of the project may grow it (say, a guided-decoding spec)."""

    extra_field: dict[str, Any] | None = None


def _echo(engine: Any, value: Any) -> Any:
    return value


def test_sampling_params_cross_the_channel_whole(server: Any) -> None:
    """A field the wire format has never heard of reaches the core unchanged."""
    import asyncio

    params = SamplingParams(max_tokens=2, stop=["zz"], logit_bias={3: 1.5}, seed=7)
    assert server.in_core(_echo, params) == params
    extended = _Extended(max_tokens=3, temperature=0, extra_field={"schema": [1, 2]})
    assert server.in_core(_echo, extended) == extended

    async def run() -> Any:
        return [o async for o in server.engine.generate("hello", extended, "extended-1")][-1]

    final = asyncio.run(run())
    assert final.finished and len(final.outputs[0].token_ids) == 3


def test_tensor_parallel_serving_through_the_core(llama_path: Any) -> None:
    """The core's executor spawns its own TP workers; served greedy output equals offline."""
    import asyncio

    from pagedllm import Engine
    from pagedllm.engine.core_client import EngineCoreClient

    args: dict[str, Any] = dict(dtype="float32", block_size=8, num_kv_blocks=96)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = ["The quick brown fox", "def fibonacci(n):"]
    single = Engine(str(llama_path), "cpu", **args)
    try:
        want = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    finally:
        single.shutdown()
    client = EngineCoreClient(
        str(llama_path), "cpu", tensor_parallel_size=2, log_stats_interval=None, **args
    )
    try:

        async def run() -> list[list[int]]:
            async def one(i: int, p: str) -> list[int]:
                outs = [o async for o in client.generate(p, params, f"tp-{i}")]
                return outs[-1].outputs[0].token_ids

            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

        assert asyncio.run(run()) == want
    finally:
        client.stop()
    assert not client.proc.is_alive()


def _core_environment(engine: Any) -> dict[str, str | None]:
    import torch

    return {
        "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT"),
        "threads": torch.get_num_threads(),
    }


def test_the_core_spins_briefly(server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The core's OpenMP threads spin briefly, then sleep (the server needs the cores they
    would spin on), and a policy the user set is theirs."""
    from pagedllm.config import CORE_GOMP_SPINCOUNT, core_openmp_env

    user_set = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
    if not any(k in os.environ for k in user_set):
        spin = server.in_core(_core_environment)["GOMP_SPINCOUNT"]
        assert spin == str(CORE_GOMP_SPINCOUNT)
    for key in user_set:
        monkeypatch.delenv(key, raising=False)
    assert core_openmp_env() == {"GOMP_SPINCOUNT": str(CORE_GOMP_SPINCOUNT)}
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert core_openmp_env() == {}


def _frozen_objects(engine: Any) -> int:
    import gc

    return gc.get_freeze_count()


def test_the_core_freezes_its_start_up_objects(server: Any) -> None:
    """What start-up built (torch, the model) is out of the cyclic collector's walk, so a full
    collection never stalls a step for the ~150 ms that walking it takes."""
    assert server.in_core(_frozen_objects) > 10_000


def _core_thread_masks(engine: Any) -> dict[str, Any]:
    from pagedllm.engine.cpu_binding import thread_ids

    return {
        "main": os.getpid(),
        "masks": {tid: sorted(os.sched_getaffinity(tid)) for tid in thread_ids()},
    }


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="binding needs two CPUs this process may use"
)
def test_the_core_binds_its_threads_and_still_serves(llama_path: Any) -> None:
    """With a CPU binding the core's main thread runs alone on its CPU and its other threads
    (OpenMP workers, ZeroMQ's) on the rest; this process is left as it was (binding it is
    ``pagedllm serve``'s business), and requests still complete."""
    import asyncio

    from pagedllm.engine.cpu_binding import CpuBinding

    before = os.sched_getaffinity(0)
    main_cpu, rest_cpu = sorted(before)[:2]
    engine = small_core_client(
        llama_path, cpu_binding=CpuBinding(core_main=(main_cpu,), rest=(rest_cpu,))
    )
    try:
        got = asyncio.run(engine.call(_core_thread_masks))

        async def one() -> Any:
            params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            async for out in engine.generate({"prompt_token_ids": [1, 2, 3]}, params, "b-0"):
                last = out
            return last

        final = asyncio.run(one())
    finally:
        engine.stop()
    masks = {int(k): v for k, v in got["masks"].items()}
    assert masks.pop(got["main"]) == [main_cpu]
    assert masks and all(m == [rest_cpu] for m in masks.values()), masks
    assert os.sched_getaffinity(0) == before
    assert final.finished and len(final.outputs[0].token_ids) == 4

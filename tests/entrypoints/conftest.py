"""One real server for the entrypoint tests: uvicorn in a background thread on a free port.

The engine behind it is the tiny random Llama from the root conftest, on the CPU, with a fixed
number of KV blocks so tests can assert that every block comes back once requests end.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

API_KEY = "sk-test-key"
MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 128
NUM_KV_BLOCKS = 256
BLOCK_SIZE = 8
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerHandle:
    base_url: str  # http://127.0.0.1:PORT
    engine: Any  # EngineCoreClient: the engine runs in its own process, as `pagedllm serve` does
    server: Any  # uvicorn.Server
    thread: threading.Thread

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def stats(self) -> dict[str, float]:
        return self.engine.get_stats()

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Poll until nothing runs, waits or is swapped; return the stats at that point."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.engine.get_stats()
            idle = (
                stats["num_requests_running"] == 0
                and stats["num_requests_waiting"] == 0
                and stats["num_requests_swapped"] == 0
                and self.engine.num_in_flight == 0
            )
            if idle:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout}s: {stats}")
            time.sleep(0.02)

    def assert_all_blocks_free(self) -> None:
        stats = self.wait_idle()
        free, total = stats["num_free_device_blocks"], stats["num_device_blocks"]
        assert free == total, f"KV blocks leaked: {free} free of {total}"

    def offline(self, prompts: list[Any], params: Any) -> list[Any]:
        """``LLMEngine.generate`` run in the engine core (only when the server is idle)."""
        self.wait_idle()
        return self.in_core(offline_generate, prompts, params)

    def in_core(self, fn: Any, *args: Any) -> Any:
        """``fn(llm_engine, *args)`` between steps in the engine core process (fn must pickle)."""
        return asyncio.run(self.engine.call(fn, *args))


def stall_core(engine: Any, seconds: float) -> None:
    """``engine.call(stall_core, s)``: the core sleeps between steps (requests queue meanwhile)."""
    time.sleep(seconds)


def small_core_client(llama_path: Path, **extra: Any) -> Any:
    """An engine core process on the tiny Llama with a small cache, for tests that start,
    break, kill or bind their own core (the session ``server`` fixture's core is shared)."""
    from pagedllm.engine.core_client import EngineCoreClient

    return EngineCoreClient.from_engine_args(
        str(llama_path),
        "cpu",
        dtype="float32",
        num_kv_blocks=64,
        block_size=8,
        max_model_len=128,
        log_stats_interval=None,
        **extra,
    )


def offline_generate(engine: Any, prompts: list[Any], params: Any) -> list[Any]:
    return engine.generate(prompts, params, use_tqdm=False)


def start_server(app: Any, config: Any = None) -> tuple[Any, threading.Thread, int]:
    """Serve ``app`` on a free loopback port (``config``: a uvicorn.Config whose port is set)."""
    import uvicorn

    port = free_port()
    if config is None:
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    config.port = port
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return server, thread, port


@pytest.fixture(scope="session")
def server(llama_path: Path) -> Iterator[ServerHandle]:
    from pagedllm.engine.core_client import EngineCoreClient
    from pagedllm.entrypoints.openai.api_server import ServerSettings, build_app, model_info

    engine = EngineCoreClient.from_engine_args(
        str(llama_path),
        "cpu",
        dtype="float32",
        num_kv_blocks=NUM_KV_BLOCKS,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=64,
        log_stats_interval=None,
    )
    settings = ServerSettings(
        api_key=API_KEY, chat_template=CHAT_TEMPLATE, max_body_bytes=64 * 1024
    )
    app = build_app(engine, model_info(engine, [MODEL_NAME, "alias"]), settings)
    srv, thread, port = start_server(app)
    yield ServerHandle(f"http://127.0.0.1:{port}", engine, srv, thread)
    srv.should_exit = True
    thread.join(30)


@pytest.fixture(scope="session")
def client(server: ServerHandle) -> Any:
    import openai

    return openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture()
def http(server: ServerHandle) -> Iterator[Any]:
    import httpx

    with httpx.Client(
        base_url=server.base_url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}
    ) as c:
        yield c

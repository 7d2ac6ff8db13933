"""The ``pagedllm`` command: --version, --help, ``generate``, and ``serve`` with a graceful stop."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

import pagedllm
from pagedllm import SamplingParams
from pagedllm.entrypoints import cli
from tests.entrypoints.conftest import CHAT_TEMPLATE, free_port

REPO = Path(__file__).resolve().parents[2]


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"pagedllm {pagedllm.__version__}"
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "serve" in out and "generate" in out
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--device",
        "--api-key",
        "--max-model-len",
        "--kv-cache-space",
        "--chat-template",
        "--served-model-name",
        "--enable-prefix-caching",
    ):
        assert flag in out


def test_engine_flags_reach_engine_args() -> None:
    args = cli.build_parser().parse_args(
        [
            "serve",
            "m",
            "--max-num-seqs",
            "4",
            "--block-size",
            "8",
            "--enable-prefix-caching",
            "--preemption-mode",
            "swap",
            "--kv-cache-space",
            "0.5",
        ]
    )
    assert cli.engine_kwargs(args) == {
        "max_num_seqs": 4,
        "block_size": 8,
        "enable_prefix_caching": True,
        "preemption_mode": "swap",
        "kv_cache_space": 0.5,
    }
    from pagedllm.engine_args import EngineArgs

    EngineArgs.from_kwargs("m", **cli.engine_kwargs(args))  # every name is a real engine arg


def test_serve_without_model_needs_the_demo_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from pagedllm.entrypoints import demo

    monkeypatch.setattr(demo, "DEMO_MODEL", tmp_path / "no-such-demo")
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve"])
    assert "demo model" in str(exc.value.code) and "no-such-demo" in str(exc.value.code)


def test_generate_streams_the_same_text_as_the_engine(
    server: Any, llama_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = "def fibonacci(n):"
    expected = server.offline([prompt], SamplingParams(temperature=0, max_tokens=6))[0]
    code = cli.main(
        [
            "generate",
            str(llama_path),
            "--prompt",
            prompt,
            "--max-tokens",
            "6",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--num-kv-blocks",
            "16",
            "--block-size",
            "8",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0
    assert captured.out == prompt + expected.outputs[0].text + "\n"
    assert "tokens/s" in captured.err


def _wait_healthy(
    base: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 120
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early: {log.read_text()[-3000:]}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("server did not become healthy")


def test_serve_subprocess_env_key_and_graceful_sigterm(llama_path: Path, tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PAGEDLLM_API_KEY": "env-key", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "pagedllm.entrypoints.cli",
        "serve",
        str(llama_path),
        "--port",
        str(port),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--num-kv-blocks",
        "64",
        "--block-size",
        "8",
        "--max-model-len",
        "128",
        "--served-model-name",
        "tiny",
        "--chat-template",
        CHAT_TEMPLATE,
        "--shutdown-timeout",
        "20",
    ]
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(base, proc, log)
        ready = [line for line in log.read_text().splitlines() if "ready in " in line]
        assert len(ready) == 1, log.read_text()[-3000:]  # one line, with where to go
        assert re.search(r"ready in [\d.]+ s \(imports [\d.]+ s, load [\d.]+ s\)", ready[0])
        for url in (f"API {base}/v1", f"chat {base}/ ", f"dashboard {base}/dashboard"):
            assert url in ready[0], ready[0]
        assert httpx.get(base + "/v1/models").status_code == 401
        auth = {"Authorization": "Bearer env-key"}
        models = httpx.get(base + "/v1/models", headers=auth).json()
        assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 128
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 100,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        events: list[str] = []
        with httpx.stream(
            "POST", base + "/v1/chat/completions", json=body, headers=auth, timeout=60
        ) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
                    break
            proc.send_signal(signal.SIGTERM)  # mid-stream: the request is allowed to finish
            events += [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finish[-1] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 100
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        assert "Shutting down" in log.read_text() and "server stopped" in log.read_text()
        with pytest.raises(httpx.ConnectError):
            httpx.get(base + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

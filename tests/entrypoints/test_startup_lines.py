"""A start that talks: the first log line at once, a busy port found before the model loads."""

from __future__ import annotations

import argparse
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pagedllm.entrypoints.cli_args import UsageError, build_parser, model_from_args
from pagedllm.entrypoints.demo_model import fetch_demo_model

REPO = Path(__file__).resolve().parents[2]
# The issue asks for 1 s and 2 s; the start itself takes ~0.2 s, the margin is for a machine
# that runs other suites beside this one.
FIRST_LINE_S = 1.5
BUSY_PORT_S = 2.0


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[tuple[float, str | None]]:
    """stderr's lines as they come, each with its arrival time (None at the end)."""
    out: queue.Queue[tuple[float, str | None]] = queue.Queue()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            out.put((time.perf_counter(), line.rstrip("\n")))
        out.put((time.perf_counter(), None))

    threading.Thread(target=pump, daemon=True).start()
    return out


def test_busy_port_fails_fast_before_loading_with_status_1(llama_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(llama_path)]
        start = time.perf_counter()
        proc = subprocess.Popen(
            [*cmd, "--port", str(port), "--device", "cpu"],
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        lines = _lines(proc)
        try:
            first_at, first = lines.get(timeout=30)
            status = proc.wait(timeout=30)
            elapsed = time.perf_counter() - start
        finally:
            proc.kill()
    assert first is not None and "starting" in first, first
    assert first_at - start < FIRST_LINE_S, f"first line after {first_at - start:.2f} s"
    rest = []
    while (item := lines.get(timeout=5)[1]) is not None:
        rest.append(item)
    assert status == 1, rest
    assert elapsed < BUSY_PORT_S, f"failed after {elapsed:.2f} s"
    assert f"cannot listen on 127.0.0.1:{port}" in rest[-1] and "--port" in rest[-1], rest
    assert not any("loading" in line for line in rest), rest  # the model was never loaded


def _subparsers(parser: argparse.ArgumentParser, path: str = "") -> dict[str, Any]:
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                key = f"{path} {name}".strip()
                found[key] = sub
                found.update(_subparsers(sub, key))
    return found


def test_every_subcommand_help_shows_defaults_and_an_example() -> None:
    subs = _subparsers(build_parser())
    assert {"serve", "generate", "chat", "bench serve", "bench latency", "kv-cache"} <= set(subs)
    for path, sub in subs.items():
        text = sub.format_help()
        assert f"example:\n  pagedllm {path.split()[0]}" in text, path
        if path not in ("bench", "kv-cache", "inspect"):  # no valued flag with a default
            assert "(default: " in text, path
    assert "tokens to generate per prompt (default: 64)" in subs["generate"].format_help()
    serve = " ".join(subs["serve"].format_help().split())
    assert "log detail (default: info)" in serve and "(default: 16)" not in serve


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["bench", "throughput"]])
def test_demo_is_taken_wherever_a_model_is(command: list[str]) -> None:
    parser = build_parser()
    name = " ".join(command[:2] if command[0] == "bench" else command[:1])
    with pytest.raises(UsageError, match="MODEL or --demo"):
        model_from_args(parser.parse_args(command), name)
    with pytest.raises(UsageError, match="not both"):
        model_from_args(parser.parse_args([*command, "m", "--demo"]), name)
    assert model_from_args(parser.parse_args([*command, "some/model"]), name) == "some/model"
    cached = fetch_demo_model(download=False).path
    if cached is None:
        pytest.skip("the demo model is not cached here")
    assert model_from_args(parser.parse_args([*command, "--demo"]), name) == str(cached)


def test_chat_takes_a_port() -> None:
    args = build_parser().parse_args(["chat", "--demo", "--port", "8123"])
    assert args.port == 8123 and args.demo

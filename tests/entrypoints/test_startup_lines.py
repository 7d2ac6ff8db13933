"""A start that talks: the first log line at once, a busy port found before the model loads."""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

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

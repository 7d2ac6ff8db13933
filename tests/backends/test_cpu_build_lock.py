"""The CPU extension's build lock: a build killed mid-way must not leave later processes waiting.

torch's ``cpp_extension.load`` guards a build with a file that only a finished build removes; a
session interrupted while compiling once left every later test waiting on it until pytest's
timeout. These tests use the lock alone (no compiler run)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedllm.backends.cpu import _ops


def test_leftover_torch_baton_is_removed_under_our_lock(tmp_path: Path) -> None:
    baton = tmp_path / _ops._TORCH_BATON
    baton.touch()
    with _ops._build_lock(tmp_path):
        assert not baton.exists()
    assert not baton.exists()


def test_lock_of_a_killed_process_is_released(tmp_path: Path) -> None:
    """A holder killed with SIGKILL (nothing of its own runs) frees the lock: the kernel drops
    an flock with its last descriptor, unlike a lock file."""
    ready = tmp_path / "ready"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time, pathlib\n"
            "from pagedllm.backends.cpu import _ops\n"
            "d = pathlib.Path(sys.argv[1])\n"
            "with _ops._build_lock(d):\n"
            "    (d / 'lock').touch()\n"  # as torch's baton mid-build
            "    (d / 'ready').touch()\n"
            "    time.sleep(600)\n",
            str(tmp_path),
        ]
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert holder.poll() is None, "the lock holder exited early"
            assert time.monotonic() < deadline, "the lock holder never took the lock"
            time.sleep(0.05)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
        start = time.monotonic()
        with _ops._build_lock(tmp_path):
            assert not (tmp_path / _ops._TORCH_BATON).exists()
        assert time.monotonic() - start < 5
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_second_builder_waits_for_the_first(tmp_path: Path) -> None:
    """While one process holds the lock (its build running), another does not enter, and the
    holder's baton is not taken for a leftover."""
    code = (
        "import sys, pathlib\n"
        "from pagedllm.backends.cpu import _ops\n"
        "d = pathlib.Path(sys.argv[1])\n"
        "with _ops._build_lock(d):\n"
        "    (d / 'entered').touch()\n"
    )
    with _ops._build_lock(tmp_path):
        (tmp_path / _ops._TORCH_BATON).touch()
        waiter = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)])
        try:
            time.sleep(3)  # ample for the import and the flock call
            assert waiter.poll() is None
            assert not (tmp_path / "entered").exists()
            assert (tmp_path / _ops._TORCH_BATON).exists()
            (tmp_path / _ops._TORCH_BATON).unlink()  # our "build" finishes
        except BaseException:
            waiter.kill()
            raise
    assert waiter.wait(timeout=60) == 0
    assert (tmp_path / "entered").exists()


def test_a_waiting_builder_says_so_and_a_build_has_an_estimate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The first run's minutes of compiling are announced, not silent."""
    import fcntl
    import threading

    assert 1 <= _ops.build_minutes(5, cpus=2) <= 3 and _ops.build_minutes(1, cpus=64) == 1
    caplog.set_level("WARNING", logger=_ops.__name__)
    with open(tmp_path / _ops._FLOCK, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another builder at work

        def take() -> None:
            with _ops._build_lock(tmp_path):
                pass

        waiter = threading.Thread(target=take)
        waiter.start()
        deadline = time.monotonic() + 10
        while "waiting for another process" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
        fcntl.flock(held, fcntl.LOCK_UN)
    waiter.join(10)
    assert "waiting for another process building the CPU kernels" in caplog.text

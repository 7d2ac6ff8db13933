"""A cache folder's ``meta.json`` or block file that is a FIFO, a symlink (to ``/dev/zero``) or
a device turns the disk tier off with one log line, at once: nothing waits on a FIFO, nothing
reads a device without end, nothing allocates what a size claims."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedllm.kv_tiers import folders
from pagedllm.kv_tiers.disk import META, DiskTier
from tests.kv_tiers.test_disk import FP, N, payload, read, tier

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")


def within(seconds: float, fn: Callable[[], object]) -> object:
    """``fn()``, failing (not hanging) when it takes longer than ``seconds``."""
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    start = time.monotonic()
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s"
    assert time.monotonic() - start < seconds
    return out[0] if out else None


def make(path: Path, kind: str) -> None:
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        path.symlink_to("/dev/zero")
    else:  # a symlink to a regular file: not what the engine writes either
        target = path.with_name("elsewhere")
        target.write_bytes(b"{}")
        path.symlink_to(target)


def off_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "disk tier off" in r.getMessage()]


KINDS = ["fifo", "dev_zero", "symlink"]


@pytest.mark.parametrize("kind", KINDS)
def test_meta_json_not_a_regular_file(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    tier(tmp_path)  # writes meta.json
    make(tmp_path / FP.digest / META, kind)
    with caplog.at_level(logging.WARNING):
        t = within(2, lambda: tier(tmp_path))
    assert isinstance(t, DiskTier) and not t.readable and not t.writable
    assert len(off_lines(caplog)) == 1 and META in off_lines(caplog)[0]
    assert isinstance(within(2, lambda: folders.cache_folders(tmp_path)), list)  # `ls` answers


@pytest.mark.parametrize("kind", KINDS)
def test_block_file_not_a_regular_file_at_start(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    t = tier(tmp_path)
    t.write(5, payload(5))
    make(t.path_of(5), kind)
    with caplog.at_level(logging.WARNING):
        again = within(2, lambda: tier(tmp_path))
    assert isinstance(again, DiskTier) and not again.readable and not again.contains(5)
    assert len(off_lines(caplog)) == 1 and t.path_of(5).name in off_lines(caplog)[0]


@pytest.mark.parametrize("kind", KINDS)
def test_block_file_made_irregular_while_serving(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    t = tier(tmp_path)
    for key in (5, 6):
        t.write(key, payload(key))
    make(t.path_of(5), kind)
    with caplog.at_level(logging.WARNING):
        assert within(2, lambda: read(t, 5)) is None
        assert within(2, lambda: read(t, 6)) is None  # the tier is off: nothing more is read
        assert not t.write(7, payload(7))
    assert not t.readable and not t.contains(6)
    assert len(off_lines(caplog)) == 1
    assert os.path.lexists(t.path_of(5))  # not ours: left where it is


def test_an_oversized_block_file_is_damaged_not_read(tmp_path: Path) -> None:
    t = tier(tmp_path)
    t.write(5, payload(5))
    with open(t.path_of(5), "ab") as f:
        f.truncate(1 << 20)  # past any block's size: never read into memory
    again = tier(tmp_path)
    assert again.readable
    assert within(2, lambda: read(again, 5)) is None
    assert again.corrupt == 1 and not t.path_of(5).exists()
    assert read(again, 6) is None and len(bytes(payload(6))) == N

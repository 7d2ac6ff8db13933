"""The disk tier's files: round trip, LRU across restarts, damage detected and deleted, atomic
writes (a killed writer leaves nothing readable), and faults that only turn writing off."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagedllm.kv_tiers.disk import DiskTier
from pagedllm.kv_tiers.fingerprint import Fingerprint

FP = Fingerprint("ab" * 16, {"format": 1, "model": "m"})
OTHER = Fingerprint("cd" * 16, {"format": 1, "model": "other"})
N = 4096
LAYOUT = {"dtype": "uint8", "shape": [N]}
HEADER = 8 + 4 + 4  # the preamble; the JSON header follows


def tier(root: Path, fp: Fingerprint = FP, capacity: int = 1 << 30) -> DiskTier:
    return DiskTier(root, fp, capacity_bytes=capacity, payload_nbytes=N, layout=LAYOUT)


def payload(seed: int) -> memoryview:
    return memoryview(bytes((seed * 31 + i * 7) % 251 for i in range(N)))


def read(t: DiskTier, key: int) -> bytes | None:
    out = bytearray(N)
    return bytes(out) if t.read_into(key, memoryview(out)) else None


def test_round_trip_and_restart_keeps_entries_in_lru_order(tmp_path: Path) -> None:
    t = tier(tmp_path)
    for key in (1, 2, 3):
        assert t.write(key, payload(key))
    assert read(t, 2) == bytes(payload(2))
    size = t.path_of(1).stat().st_size
    for i, key in enumerate((3, 1, 2)):  # use order: 3 oldest, 2 newest
        os.utime(t.path_of(key), (1000 + i, 1000 + i))
    again = tier(tmp_path, capacity=2 * size)  # a restart with room for two: 3 goes
    assert [again.contains(k) for k in (1, 2, 3)] == [True, True, False]
    assert not again.path_of(3).exists()
    assert read(again, 1) == bytes(payload(1))
    again.write(4, payload(4))  # 2 is now the least recently used
    assert [again.contains(k) for k in (1, 2, 4)] == [True, False, True]


@pytest.mark.parametrize("damage", ["payload", "header", "truncated", "appended"])
def test_a_damaged_block_is_a_miss_and_is_deleted(tmp_path: Path, damage: str) -> None:
    t = tier(tmp_path)
    t.write(7, payload(7))
    path = t.path_of(7)
    data = bytearray(path.read_bytes())
    if damage == "payload":
        data[-100] ^= 1
    elif damage == "header":
        data[HEADER + 3] ^= 1
    elif damage == "truncated":
        data = data[:-1]
    else:
        data += b"\0"
    path.write_bytes(bytes(data))
    assert read(t, 7) is None
    assert not path.exists() and not t.contains(7) and t.corrupt == 1


def test_another_fingerprint_is_never_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other = tier(tmp_path, OTHER)
    other.write(5, payload(5))
    with caplog.at_level(logging.WARNING):
        mine = tier(tmp_path)
    assert not mine.contains(5) and read(mine, 5) is None
    assert [r for r in caplog.records if "other model" in r.getMessage()]
    # Even a file of the other model copied into this folder under the same key is refused.
    mine.path_of(5).parent.mkdir(exist_ok=True)
    mine.path_of(5).write_bytes(other.path_of(5).read_bytes())
    assert read(tier(tmp_path), 5) is None and not mine.path_of(5).exists()
    assert read(other, 5) == bytes(payload(5))


def test_meta_of_another_model_turns_the_folder_off(tmp_path: Path) -> None:
    tier(tmp_path)
    (tmp_path / FP.digest / "meta.json").write_text('{"format": 1, "model": "else"}')
    assert not tier(tmp_path).readable


def test_full_disk_warns_once_stops_writing_and_keeps_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    t = tier(tmp_path)
    t.write(1, payload(1))

    def full(self: DiskTier, path: Path, *parts: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskTier, "_atomic_write", full)
    with caplog.at_level(logging.WARNING):
        assert not t.write(2, payload(2))
        assert not t.write(3, payload(3))
    assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) == 1
    assert not t.writable and read(t, 1) == bytes(payload(1))


def test_read_only_folder_reads_what_is_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tier(tmp_path).write(1, payload(1))

    def read_only(self: DiskTier, path: Path, *parts: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(DiskTier, "_atomic_write", read_only)
    with caplog.at_level(logging.WARNING):
        t = tier(tmp_path)
    assert t.readable and not t.writable
    assert len([r for r in caplog.records if "not writable" in r.getMessage()]) == 1
    assert read(t, 1) == bytes(payload(1)) and not t.write(2, payload(2))


def test_a_folder_that_cannot_be_made_turns_the_tier_off(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    t = tier(tmp_path / "file")
    assert not t.readable and not t.write(1, payload(1))


_KILLED_WRITER = """
import os, signal, sys
from pathlib import Path
import pagedllm.kv_tiers.disk as disk
from tests.kv_tiers.test_disk import FP, payload, tier

class Dying:
    def __init__(self, f):
        self.f = f
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.f.close()
    def write(self, data):
        data = memoryview(data).cast("B")
        if {when!r} == "mid-payload" and len(data) > 1000:
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        self.f.write(data)

t = tier(Path(sys.argv[1]))
real_open = open
disk.open = lambda path, mode: Dying(real_open(path, mode))
def dying_replace(src, dst):
    os.kill(os.getpid(), signal.SIGKILL)
if {when!r} == "before-rename":
    disk.os.replace = dying_replace
t.write(9, payload(9))
"""


@pytest.mark.parametrize("when", ["mid-payload", "before-rename"])
def test_a_writer_killed_mid_write_leaves_no_readable_block(tmp_path: Path, when: str) -> None:
    tier(tmp_path)  # the folder and its meta exist, as in a running server
    script = textwrap.dedent(_KILLED_WRITER).format(when=when)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=root, check=False)
    assert proc.returncode == -signal.SIGKILL
    leftovers = list((tmp_path / FP.digest).glob("*/*.tmp"))
    assert leftovers  # the process died with its temporary file written (partly or whole)
    t = tier(tmp_path)
    assert not t.contains(9) and read(t, 9) is None
    assert not list((tmp_path / FP.digest).glob("*/*.tmp"))  # cleaned up at start

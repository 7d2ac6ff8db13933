"""Full-content digests remembered by file identity: hashed once, hashed again after any change
(an in-place rewrite with the modification time put back included), never trusted when the
file changed just before it was hashed."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from pagedllm.kv_tiers import hashes
from pagedllm.kv_tiers.hashes import HashCache, HashingStopped, file_digest


@pytest.fixture()
def weights(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(os.urandom(3 << 20))
    return path


def counting(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    calls: list[Path] = []
    real = hashes.file_digest

    def digest(path: Path, stop: threading.Event | None = None) -> str:
        calls.append(path)
        return real(path, stop)

    monkeypatch.setattr(hashes, "file_digest", digest)
    return calls


def test_digest_covers_every_byte(weights: Path) -> None:
    data = weights.read_bytes()
    assert file_digest(weights) == hashlib.sha256(data).hexdigest()


def test_remembered_across_instances_until_rewritten_in_place(
    weights: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hashes, "SETTLE_SECONDS", 0.0)
    calls = counting(monkeypatch)
    first = HashCache(tmp_path).digest(weights)
    assert HashCache(tmp_path).digest(weights) == first and len(calls) == 1
    st = os.stat(weights)
    with open(weights, "r+b") as f:  # same inode, same size, modification time put back
        f.seek(1 << 20)
        f.write(b"\x00" * 16)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert HashCache(tmp_path).digest(weights) != first and len(calls) == 2


def test_a_file_changed_just_before_is_not_remembered(
    weights: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = counting(monkeypatch)  # SETTLE_SECONDS as shipped: the file is seconds old
    cache = HashCache(tmp_path)
    assert cache.digest(weights) == cache.digest(weights) and len(calls) == 2
    assert not (tmp_path / hashes.CACHE_NAME).exists()


def test_a_damaged_or_irregular_cache_file_is_ignored(
    weights: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hashes, "SETTLE_SECONDS", 0.0)
    (tmp_path / hashes.CACHE_NAME).write_text('{"entries": [1, 2')
    assert HashCache(tmp_path).digest(weights) == file_digest(weights)
    (tmp_path / hashes.CACHE_NAME).unlink()
    os.mkfifo(tmp_path / hashes.CACHE_NAME)
    assert HashCache(tmp_path).lookup(weights) is None  # returns, does not wait on the FIFO


def test_stop_interrupts_hashing(weights: Path) -> None:
    stop = threading.Event()
    stop.set()
    with pytest.raises(HashingStopped):
        file_digest(weights, stop)

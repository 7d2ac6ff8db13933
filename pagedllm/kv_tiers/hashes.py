"""Full-content digests of checkpoint files, remembered by the file's identity.

Hashing every byte of a checkpoint costs about a second per GB (see docs/serving.md), too much
for every start, so a digest is kept in a small JSON file (``weights-sha256.json``) under the
KV cache folder, keyed by the file's identity: device, inode, size, modification time and
change time (nanoseconds).

Why these: a file replaced by a copy or a rename gets a new inode; one rewritten in place gets
a new size or modification time, and even when both are put back (``os.utime``) the change
time moves, which no user-level call can set (only changing the system clock or writing the
raw device could forge it). A file changed within the clock's granularity of being hashed
could keep all five, so a digest is remembered only when the file was last changed more than
:data:`SETTLE_SECONDS` before it was hashed and its identity did not move while hashing (like
git's "racily clean" rule); otherwise it is used for this start only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import threading
import time
from pathlib import Path

from pagedllm.kv_tiers.files import NotARegularFile, read_regular

CACHE_NAME = "weights-sha256.json"
CHUNK = 8 << 20  # hashlib releases the GIL while hashing a buffer this size
MAX_ENTRIES = 256
_MAX_CACHE_BYTES = 1 << 20
SETTLE_SECONDS = 2.0


class HashingStopped(Exception):
    """The engine shut down while a digest was being computed."""


def identity(path: Path) -> str:
    """The key a digest is remembered by (the file a symlink names, as a model may be one)."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise NotARegularFile(f"{path} is not a regular file")
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def file_digest(path: Path, stop: threading.Event | None = None) -> str:
    """SHA-256 of every byte of ``path``, streamed in chunks (SHA-256 over BLAKE2b: with the
    SHA extensions of current x86 and Arm processors it hashes about twice as fast)."""
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise NotARegularFile(f"{path} is not a regular file")
        while n := f.readinto(buf):
            h.update(view[:n])
            if stop is not None and stop.is_set():
                raise HashingStopped(str(path))
    return h.hexdigest()


class HashCache:
    """Digests by identity in ``folder/weights-sha256.json`` (in memory only when ``folder`` is
    None or cannot be written: then every start hashes again)."""

    def __init__(self, folder: str | Path | None) -> None:
        self.path = Path(folder) / CACHE_NAME if folder is not None else None
        self._entries: dict[str, list[object]] = self._load()
        self._lock = threading.Lock()

    def _load(self) -> dict[str, list[object]]:
        if self.path is None:
            return {}
        try:
            data = json.loads(read_regular(self.path, _MAX_CACHE_BYTES))
        except (OSError, ValueError):
            return {}  # absent, damaged or not a regular file: hashed again, rewritten
        entries = data.get("entries") if isinstance(data, dict) else None
        if not isinstance(entries, dict):
            return {}
        return {
            k: v
            for k, v in entries.items()
            if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)
        }

    def lookup(self, path: Path) -> str | None:
        try:
            key = identity(path)
        except OSError:
            return None
        entry = self._entries.get(key)
        return str(entry[0]) if entry is not None else None

    def digest(self, path: Path, stop: threading.Event | None = None) -> str:
        """The remembered digest of ``path``, else computed now (and remembered if settled)."""
        known = self.lookup(path)
        if known is not None:
            return known
        started, before = time.time(), identity(path)
        digest = file_digest(path, stop)
        changed_ns = int(before.rsplit(":", 1)[1])
        if identity(path) == before and started - changed_ns / 1e9 >= SETTLE_SECONDS:
            self._remember(before, digest)
        return digest

    def _remember(self, key: str, digest: str) -> None:
        with self._lock:
            self._entries = {**self._load(), **self._entries}  # another server's entries too
            self._entries[key] = [digest, time.time()]
            newest = sorted(self._entries.items(), key=lambda kv: -_used(kv[1]))
            self._entries = dict(newest[:MAX_ENTRIES])
            self._save()

    def _save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(f"{CACHE_NAME}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            tmp.write_text(json.dumps({"version": 1, "entries": self._entries}))
            os.replace(tmp, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()


def _used(entry: list[object]) -> float:
    value = entry[1]
    return float(value) if isinstance(value, int | float) else 0.0

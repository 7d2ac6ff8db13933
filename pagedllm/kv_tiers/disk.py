"""The disk tier: one file per KV block under ``kv_cache_dir/<fingerprint>/``, LRU by use.

File format (little-endian)::

    magic  b"PGLLMKV1"                     8 bytes
    header length, CRC-32 of the header    2 x uint32
    header                                 JSON: format, fingerprint, key, dtype, shape, nbytes,
                                           CRC-32 of the payload
    payload                                nbytes: the block's bytes, layer by layer

A file is written under a temporary name and renamed into place, so a process killed while
writing leaves at most a ``*.tmp`` file (removed at the next start), never a block file. What
a torn write, a bad disk or an editor leaves is caught on reading: any mismatch (magic, lengths,
either CRC, fingerprint, key, size) makes the block a miss, and the file is deleted. No fsync:
after a power loss a renamed file may lack its data, which the CRC catches the same way.

The index (key -> bytes, least recently used first) lives in memory and is rebuilt at start by
scanning the folder, ordered by modification time, which reads refresh. Faults never stop the
engine: a folder that cannot be made or read turns the tier off, a read-only folder or a full
disk stops writing; each says so once in the log.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import struct
import threading
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

from pagedllm.kv_tiers.files import (
    FileTooLarge,
    NotARegularFile,
    check_regular,
    open_regular,
    read_regular,
)
from pagedllm.kv_tiers.fingerprint import FORMAT_VERSION, Fingerprint

logger = logging.getLogger(__name__)

MAGIC = b"PGLLMKV1"
_PREAMBLE = struct.Struct("<8sII")
SUFFIX = ".kvb"
META = "meta.json"
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
_MAX_META_BYTES = 1 << 20
_MAX_HEADER_BYTES = 1 << 16


def key_name(key: int) -> str:
    return f"{key:032x}"


def encode_header(fingerprint: str, key: int, payload: memoryview, layout: dict[str, Any]) -> bytes:
    header = json.dumps(
        {
            "format": FORMAT_VERSION,
            "fingerprint": fingerprint,
            "key": key_name(key),
            "nbytes": payload.nbytes,
            "crc32": zlib.crc32(payload),
            **layout,
        },
        sort_keys=True,
    ).encode()
    return _PREAMBLE.pack(MAGIC, len(header), zlib.crc32(header)) + header


class DiskTier:
    """One fingerprint's folder of block files; thread-safe (a writer and a reader thread)."""

    def __init__(
        self,
        root: str | Path,
        fingerprint: Fingerprint,
        *,
        capacity_bytes: int,
        payload_nbytes: int,
        layout: dict[str, Any],
    ) -> None:
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.folder = self.root / fingerprint.digest
        self.capacity_bytes = capacity_bytes
        self.payload_nbytes = payload_nbytes
        self.layout = layout  # dtype and shape, written into every header
        self.readable = False
        self.writable = False
        self.used_bytes = 0
        self.corrupt = 0  # files found bad and deleted
        self._index: OrderedDict[int, int] = OrderedDict()
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._open()

    # -- start -------------------------------------------------------------------------------------
    def _warn_once(self, what: str, message: str, *args: object) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(message, *args)

    def _disable(self, exc: OSError) -> None:
        """Turn the tier off for good: a file in the folder is not what this engine writes (a
        FIFO, a device, a symlink), so nothing there is trusted. One log line."""
        self._warn_once("irregular", "kv_cache_dir: %s; disk tier off", exc)
        with self._lock:
            self.readable = self.writable = False
            self._index.clear()
            self.used_bytes = 0

    def _open(self) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if not self._meta_matches():
                return
            self.readable = True
            self._scan()
        except (NotARegularFile, FileTooLarge) as exc:
            self._disable(exc)
            return
        except OSError as exc:
            self._warn_once(
                "open", "kv_cache_dir: cannot use %s (%s); disk tier off", self.root, exc
            )
            self.readable = False
            return
        self.writable = self._probe_writable()
        others = self._other_fingerprints()
        if others and not self._index:
            self._warn_once(
                "others",
                "kv_cache_dir: %s holds KV blocks of %d other model(s) or setting(s); none is "
                "read (this one is %s, empty)",
                self.root,
                len(others),
                self.fingerprint.digest,
            )
        logger.info(
            "disk KV tier %s: %d blocks, %.2f of %.2f GiB%s",
            self.folder,
            len(self._index),
            self.used_bytes / (1 << 30),
            self.capacity_bytes / (1 << 30),
            "" if self.writable else " (read-only)",
        )

    def _meta_matches(self) -> bool:
        """The folder's meta.json is this fingerprint's (written when new)."""
        meta = self.folder / META
        if not os.path.lexists(meta):
            with contextlib.suppress(OSError):  # a read-only folder keeps no meta; still fine
                self._atomic_write(meta, json.dumps(self.fingerprint.fields, indent=1).encode())
            return True
        try:
            fields = json.loads(read_regular(meta, _MAX_META_BYTES))
        except (NotARegularFile, FileTooLarge):
            raise  # the tier goes off, saying what the file is
        except (OSError, ValueError):
            fields = None
        mine = {k: v for k, v in self.fingerprint.fields.items() if k != "model_path"}
        if not isinstance(fields, dict) or {
            k: v for k, v in fields.items() if k != "model_path"
        } != json.loads(json.dumps(mine)):
            self._warn_once(
                "meta", "kv_cache_dir: %s does not describe this model; disk tier off", meta
            )
            return False
        return True

    def _probe_writable(self) -> bool:
        probe = self.folder / f".probe.{os.getpid()}"
        try:
            self._atomic_write(probe, b"")
            probe.unlink()
            return True
        except OSError as exc:
            self._warn_once(
                "readonly",
                "kv_cache_dir: %s is not writable (%s); blocks are only read",
                self.folder,
                exc,
            )
            return False

    def _scan(self) -> None:
        found: list[tuple[float, int, int]] = []
        for path in [*self.folder.glob("*.tmp"), *self.folder.glob("*/*")]:
            if path.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    path.unlink()  # left by a process killed while writing
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                key = int(path.name[: -len(SUFFIX)], 16)
            except ValueError:
                continue
            try:
                st = check_regular(path, self._max_file_bytes)
            except FileTooLarge:
                st = os.lstat(path)  # a damaged block: deleted when read
            except NotARegularFile:
                raise  # a FIFO, device or symlink among the blocks: the tier goes off
            except OSError:
                continue
            found.append((st.st_mtime, key, st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self.used_bytes += size
        self._make_room(0)

    def _other_fingerprints(self) -> list[Path]:
        try:
            return [p for p in self.root.iterdir() if p != self.folder and (p / META).is_file()]
        except OSError:
            return []

    @property
    def _max_file_bytes(self) -> int:
        return _PREAMBLE.size + _MAX_HEADER_BYTES + self.payload_nbytes

    # -- index -------------------------------------------------------------------------------------
    def path_of(self, key: int) -> Path:
        name = key_name(key)
        return self.folder / name[:2] / (name + SUFFIX)

    def contains(self, key: int) -> bool:
        with self._lock:
            return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def _make_room(self, nbytes: int) -> None:
        """Delete least recently used files until ``nbytes`` more fit (lock held or at start)."""
        while self._index and self.used_bytes + nbytes > self.capacity_bytes:
            key, size = self._index.popitem(last=False)
            self.used_bytes -= size
            with contextlib.suppress(OSError):
                self.path_of(key).unlink()

    def discard(self, key: int) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.used_bytes -= size
        with contextlib.suppress(OSError):
            self.path_of(key).unlink()

    # -- I/O (the store's threads) -----------------------------------------------------------------
    def _atomic_write(self, path: Path, *parts: bytes | memoryview) -> None:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                for part in parts:
                    f.write(part)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise

    def write(self, key: int, payload: memoryview) -> bool:
        """Store one block (atomically); False when the tier cannot take it."""
        if not self.writable:
            return False
        header = encode_header(self.fingerprint.digest, key, payload, self.layout)
        size = len(header) + payload.nbytes
        if size > self.capacity_bytes:
            return False
        with self._lock:
            self._make_room(size)
        path = self.path_of(key)
        try:
            path.parent.mkdir(exist_ok=True)
            self._atomic_write(path, header, payload)
        except OSError as exc:
            if exc.errno in _FULL:
                self.writable = False
                self._warn_once(
                    "full",
                    "kv_cache_dir: cannot write to %s (%s); the disk tier stops "
                    "writing and keeps reading",
                    self.folder,
                    exc,
                )
            else:
                self._warn_once(
                    f"write{exc.errno}", "kv_cache_dir: writing a block failed: %s", exc
                )
            return False
        with self._lock:
            old = self._index.pop(key, None)
            self.used_bytes += size - (old or 0)
            self._index[key] = size
        return True

    def read_into(self, key: int, out: memoryview) -> bool:
        """Fill ``out`` with the block's payload; False (and the file deleted) unless intact."""
        if not self.readable:
            return False
        path = self.path_of(key)
        try:
            fd, _ = open_regular(path, self._max_file_bytes)
            with open(fd, "rb", closefd=True) as f:
                ok = self._read_checked(f, key, out)
        except FileNotFoundError:
            ok = None
        except NotARegularFile as exc:
            self._disable(exc)
            return False
        except FileTooLarge:
            ok = False
        except OSError as exc:
            self._warn_once(f"read{exc.errno}", "kv_cache_dir: reading a block failed: %s", exc)
            ok = False
        if ok:
            with self._lock:
                if key in self._index:
                    self._index.move_to_end(key)
            with contextlib.suppress(OSError):
                os.utime(path)  # the LRU order survives a restart
            return True
        if ok is False:
            self.corrupt += 1
            self._warn_once(
                "damaged",
                "kv_cache_dir: block file %s is damaged; deleted and recomputed (further damaged "
                "blocks are counted in kv_tier_corrupt, not logged)",
                path,
            )
            logger.debug("kv_cache_dir: damaged block %s deleted", path)
        self.discard(key)
        return False

    def _read_checked(self, f: Any, key: int, out: memoryview) -> bool:
        pre = f.read(_PREAMBLE.size)
        if len(pre) != _PREAMBLE.size:
            return False
        magic, hlen, hcrc = _PREAMBLE.unpack(pre)
        if magic != MAGIC or hlen > _MAX_HEADER_BYTES:
            return False
        raw = f.read(hlen)
        if len(raw) != hlen or zlib.crc32(raw) != hcrc:
            return False
        try:
            header = json.loads(raw)
        except ValueError:
            return False
        expected = {
            "format": FORMAT_VERSION,
            "fingerprint": self.fingerprint.digest,
            "key": key_name(key),
            "nbytes": out.nbytes,
        }
        if any(header.get(k) != v for k, v in expected.items()):
            return False
        if f.readinto(out) != out.nbytes or f.read(1):
            return False
        return zlib.crc32(out) == header.get("crc32")

    def touch(self, key: int) -> None:
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)

"""Opening the cache folder's own files without trusting them to be files.

A ``meta.json`` or a block file made a FIFO would block ``open`` for good; one made a symlink to
``/dev/zero`` or a device would be read without end. Each is opened without following a symlink
and without blocking, then checked with ``fstat`` (the opened object, not the name, so a swap
between the check and the read changes nothing) to be a regular file of at most a given size.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_FLAGS |= getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)


class NotARegularFile(OSError):
    """A path that is a symlink, FIFO, socket, device or folder."""


class FileTooLarge(OSError):
    """A regular file past the size it may have."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a folder"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def check_regular(path: Path, max_bytes: int) -> os.stat_result:
    """``lstat`` of ``path``: NotARegularFile unless a regular file, FileTooLarge past
    ``max_bytes``."""
    st = os.lstat(path)
    _check(path, st, max_bytes)
    return st


def _check(path: Path, st: os.stat_result, max_bytes: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise NotARegularFile(f"{path} is {_kind(st.st_mode)}, not a regular file")
    if st.st_size > max_bytes:
        raise FileTooLarge(f"{path} holds {st.st_size} bytes (at most {max_bytes} expected)")


def open_regular(path: Path, max_bytes: int) -> tuple[int, os.stat_result]:
    """A read-only descriptor of ``path`` (never blocking, never following a symlink) and its
    ``fstat``; NotARegularFile or FileTooLarge (the descriptor closed) unless a regular file
    within the bound.
    A symlink is refused by the kernel (ELOOP), reported as NotARegularFile too."""
    try:
        fd = os.open(path, _FLAGS)
    except OSError as exc:
        if os.path.islink(path):
            raise NotARegularFile(f"{path} is a symlink, not a regular file") from exc
        raise
    try:
        st = os.fstat(fd)
        _check(path, st, max_bytes)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_regular(path: Path, max_bytes: int) -> bytes:
    """The bytes of a regular file of at most ``max_bytes`` (NotARegularFile, FileTooLarge)."""
    fd, _ = open_regular(path, max_bytes)
    with open(fd, "rb", closefd=True) as f:
        return f.read(max_bytes + 1)[:max_bytes]

"""The fingerprint folders under a ``kv_cache_dir``, for ``pagedllm kv-cache ls|clear``.

Only folders this engine made are touched: a 32-hex-digit name holding a ``meta.json``. No
torch here, so the command answers at once.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.kv_tiers.disk import META, SUFFIX
from pagedllm.kv_tiers.files import read_regular

_NAME = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class CacheFolder:
    path: Path
    meta: dict[str, Any]  # the fingerprint's fields (model, dtypes, geometry...)
    blocks: int
    bytes: int
    last_used: float | None  # newest block file's modification time (reads refresh it)

    @property
    def fingerprint(self) -> str:
        return self.path.name


def cache_folders(root: str | Path) -> list[CacheFolder]:
    """The fingerprint folders under ``root`` (most recently used first); ValueError naming
    ``kv_cache_dir`` when it is not a folder."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"kv_cache_dir: {str(root)!r} is not a folder")
    out = []
    for path in root.iterdir():
        if not (_NAME.match(path.name) and (path / META).is_file()):
            continue
        try:
            meta = json.loads(read_regular(path / META, 1 << 20))
        except (OSError, ValueError):  # a FIFO or device as meta.json too: listed, never read
            meta = {}
        blocks = size = 0
        newest = None
        for f in path.glob(f"*/*{SUFFIX}"):
            try:
                st = f.stat()
            except OSError:
                continue
            blocks, size = blocks + 1, size + st.st_size
            newest = st.st_mtime if newest is None else max(newest, st.st_mtime)
        out.append(CacheFolder(path, meta if isinstance(meta, dict) else {}, blocks, size, newest))
    return sorted(out, key=lambda c: -(c.last_used or 0.0))


def clear(root: str | Path, fingerprint: str | None = None) -> list[CacheFolder]:
    """Delete the fingerprint folders (or the one named); returns what was deleted."""
    folders = cache_folders(root)
    if fingerprint is not None:
        folders = [c for c in folders if c.fingerprint == fingerprint]
        if not folders:
            raise ValueError(f"fingerprint: no folder {fingerprint!r} under {str(root)!r}")
    for c in folders:
        shutil.rmtree(c.path, ignore_errors=True)
    return folders

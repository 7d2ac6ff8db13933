"""Packed group-wise panels kept on disk, so that a second start maps them instead of packing.

Packing a GGUF file's layers (and checking every packed layer against its definition on sampled
rows) was most of the demo model's start after its imports. The panels depend only on the
file's bytes, the C++ build that packed them (its layout and ISA) and the choices made at
packing (``int8_activations``, the tensor-parallel shard), so they are saved once, in one file
per such key, and later starts map that file and run on the panels where they lie
(``torch.load`` with ``mmap``, nothing copied: see :meth:`PackCache.load`).

The key: the file's SHA-256 (remembered by the file's identity: :class:`HashCache`, the KV
tiers' fingerprint, so the file is hashed once per machine, not per start), the extension's
build folder (named by a hash of its sources and flags) and ISA, :data:`LAYOUT_VERSION`, the
activation rounding and the shard. A file that does not load, or whose header or panel sizes
do not match what this build expects, is removed with one log line and rebuilt by this start.
The folder is bounded (:data:`MAX_BYTES`, least recently used files removed first); files are
written to a temporary name and renamed, so a reader never sees half of one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import torch

from pagedllm.backends.cpu.groupwise_pack import PackedGroupwise

logger = logging.getLogger(__name__)

# Raised whenever the panels' layout (csrc/gemm_q4_pack.cpp) or what this file stores changes;
# the build folder's hash covers the C++ sources too, this covers a layout chosen in Python.
LAYOUT_VERSION = 3  # 2: Q6_K / Q5_K off the dot path where the int16 tiles run (takes_dot);
# 3: Q8_0 too, and IQ4 layers at 4 bits there under int8_activations
MAX_BYTES = 8 << 30  # the folder's bound: least recently used files go first
_SUFFIX = ".packed.pt"
_ALIGN = 64  # the kernels' panels start on a cache line


class PackedSource(Protocol):
    """Where a model's weights came from and where their packed form may be kept: what the
    loader sets on the model as ``model.packed_source`` where the cache is on
    (``models/model_loader.PackedSource``)."""

    file: Path  # the single checkpoint file (a GGUF)
    folder: Path  # the cache folder
    shard: tuple[int, int]  # (tensor-parallel rank, size)


def _fields(pw: PackedGroupwise) -> list[Any]:
    return [pw.n, pw.k, pw.bits, pw.half_scales, pw.with_offset, pw.factored, pw.levels]


class PackCache:
    """One packed file: what a start looks up (:meth:`load`) and, on a miss, writes
    (:meth:`save`)."""

    def __init__(self, path: Path, key: dict[str, Any], ops: ModuleType) -> None:
        self.path = path
        self.key = key
        self._ops = ops

    @classmethod
    def for_source(cls, source: PackedSource, ops: ModuleType, *, dot: bool) -> PackCache | None:
        """The cache file of ``source`` under this build, or None (one log line) where the
        file cannot be fingerprinted."""
        from pagedllm.kv_tiers.hashes import HashCache

        built = getattr(ops, "__file__", None)
        if built is None:  # a stand-in for the extension (tests): nothing to key by
            return None
        try:
            source.folder.mkdir(parents=True, exist_ok=True)
            digest = HashCache(source.folder).digest(source.file)
        except OSError as exc:
            logger.warning("packed-weight cache off for this start: %s", exc)
            return None
        key = {
            "file_sha256": digest,
            "build": Path(built).parent.name,
            "isa": ops.built_isa(),
            "layout": LAYOUT_VERSION,
            "int8_activations": dot,
            "shard": list(source.shard),
        }
        name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        return cls(source.folder / f"{name}{_SUFFIX}", key, ops)

    def load(self) -> dict[str, PackedGroupwise] | None:
        """The layers' panels by module name, mapped from the file; None where there is no
        file, or it was refused (then removed, with one log line, to be rebuilt).

        Mapped, not read: the panels are views of the file's pages (private, read-only in
        use), so a start copies nothing (a read into fresh buffers cost 0.17-0.37 s for the
        demo file's 96 MB on a busy 2-core Zen 3, the map 0.05 s, mostly the unpickling of the
        121 records); the first decode step faults the pages in from the page cache. PyTorch's
        own buffers take 4 KB pages unless ``THP_MEM_ALLOC_ENABLE`` is set, as the page cache
        does, so the steps stream the same pages either way. The file is only ever replaced
        by a rename, never rewritten in place, so a mapped file does not change under a
        running engine (one that is removed lives on until its engine exits)."""
        if not self.path.exists():
            return None
        try:
            data = torch.load(self.path, mmap=True, weights_only=True, map_location="cpu")
            layers = self._validated(data)
        except Exception as exc:  # any damage (zip, unpickling, header, sizes): rebuild
            logger.warning("packed-weight cache %s refused, repacking: %s", self.path.name, exc)
            with contextlib.suppress(OSError):
                self.path.unlink()
            return None
        with contextlib.suppress(OSError):
            os.utime(self.path)  # recently used: evicted last
        return layers

    def _validated(self, data: Any) -> dict[str, PackedGroupwise]:
        if not isinstance(data, dict) or data.get("key") != self.key:
            raise ValueError("its key differs from this start's (stale)")
        layers: dict[str, PackedGroupwise] = {}
        for name, (fields, packed) in data["layers"].items():
            pw = PackedGroupwise(packed, *fields)
            n, k, bits, half, with_offset, factored, levels = fields
            per_panel = self._ops.groupwise_panel_bytes(
                k, bits, half, with_offset, factored, levels
            )
            if packed.dtype != torch.uint8 or tuple(packed.shape) != ((n + 15) // 16, per_panel):
                raise ValueError(f"{name}: panels of shape {tuple(packed.shape)}")
            if packed.data_ptr() % _ALIGN:
                raise ValueError(f"{name}: panels not aligned to {_ALIGN} bytes")
            layers[name] = pw
        return layers

    def save(self, layers: dict[str, PackedGroupwise]) -> None:
        """Write the panels (atomically: a temporary file renamed), then bound the folder.
        A failure to write costs only the next start's packing (one log line)."""
        data = {
            "key": self.key,
            "layers": {name: (_fields(pw), pw.packed) for name, pw in layers.items()},
        }
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            torch.save(data, tmp)
            os.replace(tmp, self.path)
        except OSError as exc:
            logger.warning("packed-weight cache not written: %s", exc)
            with contextlib.suppress(OSError):
                tmp.unlink()
            return
        bound_folder(self.path.parent, MAX_BYTES, keep=self.path)


def bound_folder(folder: Path, max_bytes: int, *, keep: Path) -> None:
    """Remove the least recently used packed files until the folder holds ``max_bytes`` or
    less (``keep``, the file just written, stays)."""
    files = []
    for p in folder.glob(f"*{_SUFFIX}"):
        with contextlib.suppress(OSError):
            st = p.stat()
            files.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in files)
    for _, size, p in sorted(files, key=lambda f: f[0]):
        if total <= max_bytes:
            break
        if p == keep:
            continue
        with contextlib.suppress(OSError):
            p.unlink()
            total -= size

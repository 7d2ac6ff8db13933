"""A small reader for the safetensors format that reads each tensor with plain file reads.

Why not the library's memory map: a mapped file counts in the process's resident memory for
every page touched until the file is closed, so reading a 2.2 GB checkpoint through a map into
the model's own storage peaks at twice the checkpoint. ``readinto`` a fresh buffer per tensor
reads at page-cache speed and holds one tensor at a time. The format is tiny: an 8-byte
little-endian header length, a JSON header naming each tensor's dtype, shape and byte range,
then the raw data.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

# The safetensors dtype names torch can hold.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 << 20  # the format's own limit on the JSON header


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable or does not match the model."""


def read_header(path: Path, f: Any, file_size: int) -> tuple[dict[str, Any], int]:
    """The tensor entries of an open safetensors file and where its data starts."""
    raw = f.read(8)
    if len(raw) < 8:
        raise CheckpointError(f"{path}: cannot read safetensors file (shorter than its header)")
    (length,) = struct.unpack("<Q", raw)
    if length > min(_MAX_HEADER, file_size - 8):
        raise CheckpointError(
            f"{path}: cannot read safetensors file (header length {length} does not fit in "
            f"a {file_size}-byte file; truncated or not safetensors)"
        )
    try:
        header = json.loads(f.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read safetensors file (bad header: {exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: cannot read safetensors file (header is not an object)")
    header.pop("__metadata__", None)
    return header, 8 + length


def _entry(
    path: Path, name: str, info: Any, data_size: int
) -> tuple[torch.dtype, list[int], int, int]:
    """Checked (dtype, shape, start, end) of one header entry."""
    try:
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        shape = [int(d) for d in info["shape"]]
        start, end = (int(o) for o in info["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{path}: tensor {name!r} has an unusable header entry {info!r}"
        ) from exc
    expected = math.prod(shape) * dtype.itemsize
    if not 0 <= start <= end <= data_size or end - start != expected:
        raise CheckpointError(
            f"{path}: tensor {name!r} bytes [{start}, {end}) do not hold shape {shape} of "
            f"{info['dtype']} within {data_size} data bytes (truncated file?)"
        )
    return dtype, shape, start, end


def read_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of one file, in file order, each in a buffer of its own."""
    try:
        with open(path, "rb", buffering=0) as f:
            size = f.seek(0, 2)
            f.seek(0)
            header, base = read_header(path, f, size)
            entries = [(_entry(path, n, i, size - base), n) for n, i in header.items()]
            entries.sort(key=lambda e: e[0][2])  # sequential reads
            for (dtype, shape, start, end), name in entries:
                buf = torch.empty(end - start, dtype=torch.uint8)
                f.seek(base + start)
                _read_exactly(f, memoryview(buf.numpy()), path, name)
                yield name, buf.view(dtype).view(shape)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read safetensors file ({exc})") from exc


def _read_exactly(f: Any, view: memoryview, path: Path, name: str) -> None:
    """Fill ``view`` from ``f``; a single read() returns at most ~2 GiB on Linux."""
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise CheckpointError(f"{path}: tensor {name!r} ends past the end of the file")
        done += n

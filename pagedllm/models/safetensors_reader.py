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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# The safetensors dtype names torch can hold (torch's attribute names: torch is imported when a
# tensor is read, not with this module, whose CheckpointError a torch-free server imports).
_DTYPE_NAMES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
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
            f"{path}: header length {length} does not fit (expected at most "
            f"{min(_MAX_HEADER, file_size - 8)} in a {file_size}-byte file; truncated or not "
            "safetensors)"
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
    """Checked (dtype, shape, start, end) of one header entry; CheckpointError naming the
    file, the tensor, what was expected and what was found."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: header entry is {info!r} (expected an object)")
    import torch

    dtype_name = _DTYPE_NAMES.get(str(info.get("dtype")))
    if dtype_name is None:
        raise CheckpointError(
            f"{where}: dtype {info.get('dtype')!r} is unknown "
            f"(expected one of {', '.join(_DTYPE_NAMES)})"
        )
    dtype = getattr(torch, dtype_name)
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointError(f"{where}: shape {shape!r} (expected a list of integers >= 0)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise CheckpointError(
            f"{where}: data_offsets {offsets!r} (expected [start, end], integers >= 0)"
        )
    start, end = offsets
    if not start <= end <= data_size:
        raise CheckpointError(
            f"{where}: bytes [{start}, {end}) run past the {data_size} data bytes of the file "
            "(expected start <= end <= data size; truncated file?)"
        )
    expected = math.prod(shape) * dtype.itemsize
    if end - start != expected:
        raise CheckpointError(
            f"{where}: shape {shape} of {info['dtype']} needs {expected} bytes, "
            f"found [{start}, {end}) = {end - start}"
        )
    return dtype, shape, start, end


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def checked_entries(
    path: Path, header: dict[str, Any], data_size: int
) -> list[tuple[tuple[torch.dtype, list[int], int, int], str]]:
    """Every header entry checked (:func:`_entry`), in file order, none overlapping another:
    the whole header is judged before any tensor is allocated."""
    entries = [(_entry(path, n, i, data_size), n) for n, i in header.items()]
    entries.sort(key=lambda e: (e[0][2], e[0][3]))  # sequential reads
    last: tuple[int, int, str] = (0, 0, "")  # the entry reaching furthest so far
    for (_, _, start, end), name in entries:
        if start < last[1] and end > start:
            raise CheckpointError(
                f"{path}: tensor {name!r} bytes [{start}, {end}) overlap tensor {last[2]!r} "
                f"bytes [{last[0]}, {last[1]}) (expected disjoint ranges)"
            )
        if end > last[1]:
            last = (start, end, name)
    return entries


def check_safetensors(path: Path) -> None:
    """Read and check one file's header alone (the lazy reader's files, before the library
    opens them)."""
    try:
        with open(path, "rb", buffering=0) as f:
            size = f.seek(0, 2)
            f.seek(0)
            header, base = read_header(path, f, size)
            checked_entries(path, header, size - base)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read safetensors file ({exc})") from exc


def read_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of one file, in file order, each in a buffer of its own."""
    import torch

    try:
        with open(path, "rb", buffering=0) as f:
            size = f.seek(0, 2)
            f.seek(0)
            header, base = read_header(path, f, size)
            entries = checked_entries(path, header, size - base)
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

"""Our own GGUF header parser, every read bounded by the file's size; no ``gguf`` import.

Importing ggml's ``gguf`` package costs 0.2-0.3 s of every engine start (its ``quants`` module
builds lookup tables at import), and the engine only needs the header: metadata, tensor
entries, where the data starts. This module parses that (GGUF v2 and v3, little-endian, as
llama.cpp writes it) with ``struct`` over one read-only memory map, and hands tensor data out
as numpy views of the same map. A fault is a :class:`Malformed` naming the key or tensor;
``GGUFFile`` prefixes the file's path and raises it as a ``GGUFFileError``.
``test_gguf_reader.py`` compares every field and tensor with the stock ``gguf.GGUFReader``'s.
The type tables are in ``ggml_types``, the fields and tensors it hands out in ``header_values``;
this module holds the checks, so every bound on the file is read in one place.
"""

from __future__ import annotations

import itertools
import math
import mmap
import struct
from pathlib import Path

import numpy as np

from pagedllm.models.gguf.ggml_types import BLOCK_SIZES, ELEMENTS, SCALARS, GGMLType, ValueType
from pagedllm.models.gguf.header_values import (
    Array,
    Field,
    Nested,
    Numbers,
    TensorInfo,
    Text,
    Texts,
)


class Malformed(ValueError):
    """A header fault found while parsing; :class:`GGUFFile` prefixes the file's path."""


# Metadata arrays nest at most this deep (llama.cpp writes none nested at all): a deeper one is
# refused rather than walked (a 20,000-deep nesting overflowed Python's stack).
MAX_ARRAY_DEPTH = 8
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
# The fewest bytes a metadata entry (key length, an empty key, type, a 1-byte value) and a
# tensor entry (name length, an empty name, dimension count, one dimension, type, offset) take:
# a count more than the rest of the file could hold is refused before any loop.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8
_HEADER_BYTES = 24  # magic, version, tensor count, metadata count
_DEFAULT_ALIGNMENT = 32
_VERSIONS = (2, 3)
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class GGUFHeader:
    """A GGUF file's header parsed with every read bounded by the file's size: ``fields`` (the
    metadata, by key, after the pseudo-fields ``GGUF.version``, ``GGUF.tensor_count`` and
    ``GGUF.kv_count``), ``tensors`` in the file's order, ``alignment``, ``data_offset``;
    ``mapped`` is the whole file as one read-only uint8 array.

    Each count, length, nesting depth, dimension, type, offset and size is checked against the
    bytes the file has before anything is sized by it; a fault is a :class:`Malformed` naming
    the key or tensor, or (a file that is no GGUF at all) a ``ValueError`` worded as the stock
    reader words it.
    """

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        self.mapped: np.ndarray = np.frombuffer(mapping, dtype=np.uint8)
        self._buf = memoryview(mapping)
        self.size = size
        self.fields: dict[str, Field] = {}
        self.tensors: list[TensorInfo] = []
        self.alignment = _DEFAULT_ALIGNMENT
        self._parse()

    def _parse(self) -> None:
        self._check(0, 4)
        if bytes(self._buf[0:4]) != b"GGUF":
            raise ValueError("GGUF magic invalid")
        (version,) = self._unpack(_U32, 4)
        if not version & 0xFFFF and int.from_bytes(version.to_bytes(4, "little"), "big") in (
            _VERSIONS
        ):
            raise Malformed(
                "is a big-endian GGUF file; pagedllm reads the little-endian files llama.cpp "
                "writes (convert it with gguf's gguf_convert_endian.py)"
            )
        if version not in _VERSIONS:
            raise ValueError(f"Sorry, file appears to be version {version} which we cannot handle")
        (tensor_count,) = self._unpack(_U64, 8)
        (kv_count,) = self._unpack(_U64, 16)
        for offset, name, vtype, value in (
            (4, "GGUF.version", ValueType.UINT32, version),
            (8, "GGUF.tensor_count", ValueType.UINT64, tensor_count),
            (16, "GGUF.kv_count", ValueType.UINT64, kv_count),
        ):
            self.fields[name] = Field(offset, name, [vtype], value)
        offs = self._read_fields(_HEADER_BYTES, kv_count)
        offs, entries = self._read_tensor_entries(offs, tensor_count)
        alignment = self.fields.get("general.alignment")
        if alignment is not None:
            if alignment.types != [ValueType.UINT32]:
                raise ValueError("Bad type for general.alignment field")
            self.alignment = int(alignment.value)
            if self.alignment == 0 or self.alignment & (self.alignment - 1):
                raise ValueError("Invalid alignment: must be a non-zero power of two")
        offs += -offs % self.alignment
        self.data_offset = offs
        self._build_tensors(entries)

    # Bounded reads.

    def _check(self, offset: int, need: int) -> None:
        if offset < 0 or need > self.size - offset:
            where = "the GGUF header (magic, version, counts): " if offset < _HEADER_BYTES else ""
            raise Malformed(
                f"{where}{need} bytes at byte {offset} run past the end of the file "
                f"({self.size} bytes): truncated or corrupt"
            )

    def _unpack(self, fmt: struct.Struct, offset: int) -> tuple:
        self._check(offset, fmt.size)
        return fmt.unpack_from(self._buf, offset)

    def _string(self, offset: int) -> tuple[int, int]:
        """(start, end) of the bytes of the string whose length is at ``offset``."""
        (length,) = self._unpack(_U64, offset)
        left = self.size - offset - 8
        if length > left:
            raise Malformed(
                f"a string at byte {offset} claims {length} bytes; {left} are left in the "
                "file (truncated or corrupt)"
            )
        return offset + 8, offset + 8 + length

    def _value_type(self, raw: int) -> ValueType:
        try:
            return ValueType(raw)
        except ValueError:
            raise Malformed(f"has value type {raw}, which GGUF does not define") from None

    # Metadata.

    def _read_fields(self, offs: int, count: int) -> int:
        left = self.size - offs
        if count > left // _MIN_KV_BYTES:
            raise Malformed(
                f"GGUF.kv_count is {count}; the {left} bytes after the header hold at most "
                f"{left // _MIN_KV_BYTES} entries"
            )
        for i in range(count):
            start = offs
            try:
                begin, offs = self._string(offs)
                key = self._buf[begin:offs].tobytes().decode("utf-8")
            except (Malformed, UnicodeDecodeError) as exc:
                raise Malformed(f"metadata entry {i} of {count}: its key: {exc}") from None
            try:
                (raw_type,) = self._unpack(_U32, offs)
                offs, field = self._read_value(start, key, offs + 4, raw_type)
            except Malformed as exc:
                raise Malformed(f"{key}: {exc}") from None
            if key in self.fields:
                raise Malformed(f"{key} appears twice in the metadata")
            self.fields[key] = field
        return offs

    def _read_value(self, start: int, key: str, offs: int, raw_type: int) -> tuple[int, Field]:
        """(the offset after the value at ``offs``, its field)."""
        vtype = self._value_type(raw_type)
        if vtype == ValueType.STRING:
            begin, end = self._string(offs)
            return end, Field(start, key, [vtype], Text(self.mapped, begin, end))
        if vtype != ValueType.ARRAY:
            fmt = SCALARS[vtype][0]
            return offs + fmt.size, Field(start, key, [vtype], self._unpack(fmt, offs)[0])
        end, array, types, count = self._read_array(offs, 0)
        return end, Field(start, key, types, array, count)

    def _read_array(self, orig_offs: int, depth: int) -> tuple[int, Array, list[ValueType], int]:
        """(the offset after the array whose item type is at ``orig_offs``, its values, its
        types, its length)."""
        (raw_itype,) = self._unpack(_U32, orig_offs)
        (count,) = self._unpack(_U64, orig_offs + 4)
        itype, offs = self._value_type(raw_itype), orig_offs + 12
        types = [ValueType.ARRAY, itype]
        scalar = SCALARS.get(itype)
        least = scalar[1].itemsize if scalar is not None else 8
        left = self.size - offs
        if count * least > left:
            raise Malformed(
                f"an array of {count} {itype.name.lower()} values needs at least "
                f"{count * least} bytes; {left} are left in the file"
            )
        if scalar is not None:
            end = offs + count * least
            return end, Numbers(self.mapped[offs:end].view(scalar[1])), types, count
        if itype == ValueType.STRING:
            starts, ends = self._string_spans(offs, count)
            end = int(ends[-1]) if count else offs
            return end, Texts(self.mapped, starts, ends), types, count
        if depth + 1 >= MAX_ARRAY_DEPTH:
            raise Malformed(f"arrays nest deeper than {MAX_ARRAY_DEPTH} levels")
        types = [ValueType.ARRAY]  # the stock reader's: then the first element's types
        inner: list[Array] = []
        for i in range(count):  # arrays of arrays: each inner one checked the same way
            offs, array, inner_types, _ = self._read_array(offs, depth + 1)
            if i == 0:
                types += inner_types
            inner.append(array)
        return offs, Nested(inner), types, count

    def _string_spans(self, offs: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Where each of the ``count`` strings from ``offs`` starts and ends (byte offsets into
        the file, int64), every length checked against the file.

        One plain scan first (a vocabulary and its merges are ~100k strings, ~half of a start's
        header parse): a length read past the buffer raises ``struct.error`` (``OverflowError``
        once a huge length has carried the offset past what an index can hold) and an end past
        the file shows in the last one, so the checks need not run per string. Where any of
        these happens, the checked scan below finds the string at fault and names it."""
        buf, length_of = self._buf, _U64.unpack_from
        ends = [0] * count
        end = offs
        try:
            for i in range(count):  # each string starts 8 bytes after the one before ends
                end = ends[i] = end + 8 + length_of(buf, end)[0]
        except (struct.error, OverflowError):
            end = self.size + 1
        if end > self.size:
            return self._checked_spans(offs, count)
        ends_array = np.array(ends, dtype=np.int64)
        starts = np.empty_like(ends_array)
        if count:
            starts[0] = offs
            starts[1:] = ends_array[:-1]
            starts += 8
        return starts, ends_array

    def _checked_spans(self, offs: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        size, buf, length_of = self.size, self._buf, _U64.unpack_from
        starts, ends = [0] * count, [0] * count
        for i in range(count):
            if offs + 8 > size or (end := offs + 8 + length_of(buf, offs)[0]) > size:
                raise Malformed(
                    f"string {i} of {count} runs past the end of the file ({size} bytes): "
                    "truncated or corrupt"
                )
            starts[i], ends[i] = offs + 8, end
            offs = end
        return np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64)

    # Tensors.

    def _read_tensor_entries(self, offs: int, count: int) -> tuple[int, list[tuple]]:
        left = self.size - offs
        if count > left // _MIN_TENSOR_INFO_BYTES:
            raise Malformed(
                f"GGUF.tensor_count is {count}; the {left} bytes after the metadata hold at "
                f"most {left // _MIN_TENSOR_INFO_BYTES} tensor entries"
            )
        entries = []
        for _ in range(count):
            entry = offs
            begin, offs = self._string(offs)
            try:
                name = self._buf[begin:offs].tobytes().decode("utf-8")
            except UnicodeDecodeError:
                raise Malformed(f"a tensor name at byte {entry} is not UTF-8") from None
            try:
                (n_dims,) = self._unpack(_U32, offs)
                if not 1 <= n_dims <= MAX_DIMS:
                    raise Malformed(f"has {n_dims} dimensions (ggml allows 1 to 4)")
                dims = self._unpack(struct.Struct(f"<{n_dims}Q"), offs + 4)
                offs += 4 + 8 * n_dims
                (raw_type,) = self._unpack(_U32, offs)
                (offset,) = self._unpack(_U64, offs + 4)
            except Malformed as exc:
                raise Malformed(f"tensor {name}: {exc}") from None
            offs += 12
            entries.append((name, dims, raw_type, offset, entry))
        return offs, entries

    def _build_tensors(self, entries: list[tuple]) -> None:
        """Each tensor's type known, dimensions positive, data inside the data section,
        aligned, and overlapping no other tensor's; then its data as a view of the map."""
        section = self.size - self.data_offset
        spans: list[tuple[int, int, str]] = []
        checked = []
        for name, dims, raw_type, rel, entry in entries:
            try:
                qtype = GGMLType(raw_type)
            except ValueError:
                raise Malformed(f"{name} has type {raw_type}, which ggml does not define") from None
            if qtype not in BLOCK_SIZES:
                raise Malformed(
                    f"{name} has type {qtype.name}, whose block size ggml does not give"
                )
            shape = list(dims)  # ggml's order: the first is contiguous
            if any(d <= 0 for d in shape):
                raise Malformed(f"{name} has shape {shape} (every dimension must be positive)")
            block, type_size = BLOCK_SIZES[qtype]
            if shape[0] % block:
                raise Malformed(
                    f"{name} of type {qtype.name} has {shape[0]} columns, not a multiple of its "
                    f"block of {block}"
                )
            nbytes = math.prod(shape) // block * type_size
            if rel % self.alignment:
                raise Malformed(f"{name}'s data offset {rel} is not a multiple of {self.alignment}")
            if rel + nbytes > section:
                raise Malformed(
                    f"{name} needs {nbytes} bytes at offset {rel} of the data section, which "
                    f"holds {max(section, 0)} bytes: the file is truncated or the offset is wrong"
                )
            spans.append((rel, rel + nbytes, name))
            checked.append((name, qtype, tuple(shape), rel, nbytes, entry))
        spans.sort()
        for (_, end, before), (begin, _, after) in itertools.pairwise(spans):
            if begin < end:
                raise Malformed(f"{after}'s data (from offset {begin}) overlaps {before}'s")
        names: set[str] = set()
        for name, qtype, dims, rel, nbytes, entry in checked:
            if name in names:
                raise ValueError(f"Found duplicated tensor with name {name}")
            names.add(name)
            start = self.data_offset + rel
            raw = self.mapped[start : start + nbytes]
            shape = dims[::-1]  # numpy's order: the last is contiguous
            element = ELEMENTS.get(qtype)
            if element is not None:
                data = raw.view(element).reshape(shape)
            else:
                block, type_size = BLOCK_SIZES[qtype]
                data = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
            self.tensors.append(TensorInfo(name, qtype, dims, rel, start, data, entry))

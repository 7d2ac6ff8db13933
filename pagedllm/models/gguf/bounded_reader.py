"""The stock ``gguf.GGUFReader`` with every read bounded by the file's size.

Imported only when a GGUF file is opened (``reader.GGUFFile``), so importing the reader module
costs no ``gguf`` import. A fault is a :class:`Malformed` naming the key or tensor;
``GGUFFile`` prefixes the file's path and raises it as a ``GGUFFileError``.
"""

from __future__ import annotations

import itertools
import math
import struct
from typing import Any

import numpy as np

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField


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


class BoundedReader(GGUFReader):
    """``gguf.GGUFReader`` with every read bounded by the file, and two costs taken out.

    Bounds: each read the parse makes (counts, string and array lengths, nesting depth,
    dimensions, types, tensor offsets and sizes) is checked against the bytes the file has
    before anything is sized by it, in the one pass the package's parser makes; a fault is a
    ``Malformed`` naming the key or tensor (``GGUFFile`` adds the path). Costs:

    1. Its ``np.memmap`` is held as a plain ``ndarray`` view of the same mapping (nothing
       copied): the memmap subclass's ``__array_finalize__`` on each slice made a 49k-token
       vocabulary take 2.4 s to parse, a plain view a third of that.
    2. Arrays are split into the package's own ``ReaderField`` parts in one pass instead of one
       recursive call and typed numpy view per element (a vocabulary's tokens, scores, token
       types and merges are ~250k elements): a scalar array is one view of all its values (what
       ``ReaderField.contents()`` flattens anyway), a string array is a
       :class:`StringArrayField`: where each string starts and ends, found in one scan of the
       lengths, and decoded only when its contents are asked for (a cached tokenizer never
       asks: the vocabulary and merges of a 49k-token file were ~100k numpy slices, 0.3-0.4 s
       of every start). ``test_gguf_reader.py`` compares every field with the stock reader's.
    """

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = np.asarray(value).view(np.ndarray)

    def _left(self, offset: int) -> int:
        return int(self._plain.nbytes) - offset

    def _get(
        self, offset: int, dtype: Any, count: int = 1, override_order: Any = None
    ) -> np.ndarray:
        need = int(count) * np.dtype(dtype).itemsize
        if offset < 0 or need > self._left(offset):
            where = "the GGUF header (magic, version, counts): " if offset < 24 else ""
            raise Malformed(
                f"{where}{need} bytes at byte {offset} run past the end of the file "
                f"({self._plain.nbytes} bytes): truncated or corrupt"
            )
        return super()._get(offset, dtype, count, override_order)

    def _get_str(self, offset: int) -> tuple[np.ndarray, np.ndarray]:
        slen = self._get(offset, np.uint64)
        length, left = int(slen[0]), self._left(offset + 8)
        if length > left:
            raise Malformed(
                f"a string at byte {offset} claims {length} bytes; {left} are left in the "
                "file (truncated or corrupt)"
            )
        return slen, self._get(offset + 8, np.uint8, length)

    def _value_type(self, raw: Any) -> Any:
        try:
            return GGUFValueType(int(raw))
        except ValueError:
            raise Malformed(f"has value type {int(raw)}, which GGUF does not define") from None

    def _build_fields(self, offs: int, count: Any) -> int:
        count, left = int(count), self._left(offs)
        if count > left // _MIN_KV_BYTES:
            raise Malformed(
                f"GGUF.kv_count is {count}; the {left} bytes after the header hold at most "
                f"{left // _MIN_KV_BYTES} entries"
            )
        for i in range(count):
            start = offs
            try:
                klen, kdata = self._get_str(offs)
                key = bytes(kdata).decode("utf-8")
            except (Malformed, UnicodeDecodeError) as exc:
                raise Malformed(f"metadata entry {i} of {count}: its key: {exc}") from None
            offs += 8 + int(kdata.nbytes)
            try:
                raw_type = self._get(offs, np.uint32)
                size, parts, idxs, types = self._get_field_parts(offs + 4, raw_type[0])
            except Malformed as exc:
                raise Malformed(f"{key}: {exc}") from None
            if key in self.fields:
                raise Malformed(f"{key} appears twice in the metadata")
            field = StringArrayField if _is_string_spans(types, parts) else ReaderField
            self.fields[key] = field(
                start, key, [klen, kdata, raw_type, *parts], [i + 3 for i in idxs], types
            )
            offs += 4 + size
        return offs

    def _get_field_parts(self, orig_offs: int, raw_type: Any, depth: int = 0) -> tuple:
        if self._value_type(raw_type) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        itype, count, offs = self._value_type(raw_itype[0]), int(alen[0]), orig_offs + 12
        types = [GGUFValueType.ARRAY, itype]
        nptype = self.gguf_scalar_to_np.get(itype)
        least = np.dtype(nptype).itemsize if nptype is not None else 8
        if count * least > self._left(offs):
            raise Malformed(
                f"an array of {count} {itype.name.lower()} values needs at least "
                f"{count * least} bytes; {self._left(offs)} are left in the file"
            )
        if nptype is not None:
            values = self._get(offs, nptype, count)
            return 12 + int(values.nbytes), [raw_itype, alen, values], [2], types
        if itype == GGUFValueType.STRING:
            if depth:  # inside an array of arrays: the stock layout, string by string
                end, strings, idxs = _string_parts(self, orig_offs, count)
                return end - orig_offs, [raw_itype, alen, *strings], [2 + i for i in idxs], types
            starts, ends = _string_spans(self, orig_offs, count)
            end = int(ends[-1]) if count else orig_offs + 12
            return end - orig_offs, [raw_itype, alen, starts, ends, self._plain], [2, 3], types
        if depth + 1 >= MAX_ARRAY_DEPTH:
            raise Malformed(f"arrays nest deeper than {MAX_ARRAY_DEPTH} levels")
        types = [GGUFValueType.ARRAY]  # the stock reader's: then the first element's types
        parts: list[np.ndarray] = [raw_itype, alen]
        idxs: list[int] = []
        for i in range(count):  # arrays of arrays: each inner one checked the same way
            size, inner, inner_idxs, inner_types = self._get_field_parts(
                offs, GGUFValueType.ARRAY, depth + 1
            )
            if i == 0:
                types += inner_types
            idxs += (j + len(parts) for j in inner_idxs)
            parts += inner
            offs += size
        return offs - orig_offs, parts, idxs, types

    def _get_tensor_info_field(self, orig_offs: int) -> Any:
        name_len, name_data = self._get_str(orig_offs)
        try:
            name = bytes(name_data).decode("utf-8")
        except UnicodeDecodeError:
            raise Malformed(f"a tensor name at byte {orig_offs} is not UTF-8") from None
        offs = orig_offs + 8 + int(name_data.nbytes)
        try:
            n_dims = self._get(offs, np.uint32)
            if not 1 <= int(n_dims[0]) <= MAX_DIMS:
                raise Malformed(f"has {int(n_dims[0])} dimensions (ggml allows 1 to 4)")
            dims = self._get(offs + 4, np.uint64, n_dims[0])
            offs += 4 + int(dims.nbytes)
            raw_dtype, offset = self._get(offs, np.uint32), self._get(offs + 4, np.uint64)
        except Malformed as exc:
            raise Malformed(f"tensor {name}: {exc}") from None
        parts = [name_len, name_data, n_dims, dims, raw_dtype, offset]
        return ReaderField(orig_offs, name, parts, [1, 3, 4, 5])

    def _build_tensor_info(self, offs: int, count: Any) -> tuple[int, list]:
        count, left = int(count), self._left(offs)
        if count > left // _MIN_TENSOR_INFO_BYTES:
            raise Malformed(
                f"GGUF.tensor_count is {count}; the {left} bytes after the metadata hold at "
                f"most {left // _MIN_TENSOR_INFO_BYTES} tensor entries"
            )
        return super()._build_tensor_info(offs, count)

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        _check_tensor_spans(fields, start_offs, int(self._plain.nbytes), int(self.alignment))
        super()._build_tensors(start_offs, fields)


def _is_string_spans(types: list[Any], parts: list[np.ndarray]) -> bool:
    """A top-level string array as :func:`_string_spans` leaves it (not the stock layout)."""
    return (
        len(types) == 2
        and types[0] == GGUFValueType.ARRAY
        and types[1] == GGUFValueType.STRING
        and len(parts) == 5
        and parts[2].dtype == np.int64
    )


class StringArrayField(ReaderField):
    """A metadata array of strings kept as where each string's bytes start and end in the
    mapped file (``parts``: key length, key, type, item type, count, starts, ends, the file's
    mapping); its strings are decoded when ``contents()`` asks, never during the parse."""

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        starts, ends, mapped = self.parts[5], self.parts[6], self.parts[7]
        if isinstance(index_or_slice, int):
            i = index_or_slice
            return mapped[int(starts[i]) : int(ends[i])].tobytes().decode("utf-8")
        starts, ends = starts[index_or_slice], ends[index_or_slice]
        if not len(starts):
            return []
        base = int(starts.min())
        block = mapped[base : int(ends.max())].tobytes()  # one copy, then slices of it
        return [
            block[s - base : e - base].decode("utf-8")
            for s, e in zip(starts.tolist(), ends.tolist(), strict=True)
        ]


def _string_spans(reader: Any, orig_offs: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Where each of the ``count`` strings of the array whose header is at ``orig_offs``
    starts and ends (byte offsets into the file, int64), every length checked against the file
    in one scan."""
    data = reader._plain
    size = int(data.nbytes)
    length_of = struct.Struct("<Q" if _little(reader) else ">Q").unpack_from
    starts, ends = [0] * count, [0] * count
    offs = orig_offs + 12
    for i in range(count):
        if offs + 8 > size:
            raise Malformed(
                f"string {i} of {count} runs past the end of the file ({size} bytes): "
                "truncated or corrupt"
            )
        start = offs + 8
        offs = start + length_of(data, offs)[0]
        if offs > size:
            raise Malformed(
                f"string {i} of {count} runs past the end of the file ({size} bytes): "
                "truncated or corrupt"
            )
        starts[i], ends[i] = start, offs
    return np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64)


def _little(reader: Any) -> bool:
    """Whether the file's integers are little-endian (``byte_order`` "I": the machine's)."""
    import sys

    native = sys.byteorder == "little"
    return native if reader.byte_order == "I" else not native


def _string_parts(
    reader: Any, orig_offs: int, count: int
) -> tuple[int, list[np.ndarray], list[int]]:
    """The ``count`` strings of the array whose header is at ``orig_offs``: (the offset after
    them, each string's length and bytes as parts, the index of each string's bytes part)."""
    data = reader._plain
    mem = memoryview(data)
    order = "little" if _little(reader) else "big"
    parts: list[np.ndarray] = []
    idxs: list[int] = []
    offs = orig_offs + 12
    for i in range(count):
        end = offs + 8 + int.from_bytes(mem[offs : offs + 8], order)
        if end > len(mem) or offs + 8 > len(mem):
            raise Malformed(
                f"string {i} of {count} runs past the end of the file ({len(mem)} bytes): "
                "truncated or corrupt"
            )
        # Plain ndarray slices (uint8; the length too): unlike memoryviews they are not tracked
        # by the garbage collector, and the parsed file stays cached (loading.open_gguf): 200k
        # tracked objects slowed every full collection.
        parts += (data[offs : offs + 8], data[offs + 8 : end])
        idxs.append(len(parts) - 1)
        offs = end
    return offs, parts, idxs


def _check_tensor_spans(fields: list, start: int, file_size: int, alignment: int) -> None:
    """Each tensor's type known, dimensions positive, data inside the data section (which
    starts at ``start``), aligned, and overlapping no other tensor's."""
    section = file_size - start
    spans: list[tuple[int, int, str]] = []
    for field in fields:
        name = field.name
        _, _, _, dims, raw_dtype, offset = field.parts
        try:
            qtype = GGMLQuantizationType(int(raw_dtype[0]))
        except ValueError:
            raise Malformed(
                f"{name} has type {int(raw_dtype[0])}, which ggml does not define"
            ) from None
        if qtype not in GGML_QUANT_SIZES:
            raise Malformed(f"{name} has type {qtype.name}, whose block size ggml does not give")
        shape = [int(d) for d in dims]  # ggml's order: the first is contiguous
        if any(d <= 0 for d in shape):
            raise Malformed(f"{name} has shape {shape} (every dimension must be positive)")
        block, type_size = GGML_QUANT_SIZES[qtype]
        if shape[0] % block:
            raise Malformed(
                f"{name} of type {qtype.name} has {shape[0]} columns, not a multiple of its "
                f"block of {block}"
            )
        nbytes = math.prod(shape) // block * type_size
        rel = int(offset[0])
        if rel % alignment:
            raise Malformed(f"{name}'s data offset {rel} is not a multiple of {alignment}")
        if rel + nbytes > section:
            raise Malformed(
                f"{name} needs {nbytes} bytes at offset {rel} of the data section, which holds "
                f"{max(section, 0)} bytes: the file is truncated or the offset is wrong"
            )
        spans.append((rel, rel + nbytes, name))
    spans.sort()
    for (_, end, before), (begin, _, after) in itertools.pairwise(spans):
        if begin < end:
            raise Malformed(f"{after}'s data (from offset {begin}) overlaps {before}'s")

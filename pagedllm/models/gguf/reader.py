"""Opening a GGUF file with ggml's own ``gguf`` package, and reading its metadata.

The file is memory-mapped by ``gguf.GGUFReader``; tensor data stays in the page cache until a
tensor is converted. Every error names the file and, where there is one, the field or tensor:
a truncated or corrupt file must fail at start-up with one line, never load wrong weights.
"""

from __future__ import annotations

import itertools
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pagedllm.models.safetensors_reader import CheckpointError

logger = logging.getLogger(__name__)

_MISSING = object()


class GGUFFileError(CheckpointError):
    """A GGUF file refused: one line naming the file, the key or tensor as the file spells it,
    what was expected and what was found."""


class _Malformed(ValueError):
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


def _reader_class() -> type:
    """``gguf.GGUFReader`` with every read bounded by the file, and two costs taken out.

    Bounds: each read the parse makes (counts, string and array lengths, nesting depth,
    dimensions, types, tensor offsets and sizes) is checked against the bytes the file has
    before anything is sized by it, in the one pass the package's parser makes; a fault is a
    ``_Malformed`` naming the key or tensor (``GGUFFile`` adds the path). Costs:

    1. Its ``np.memmap`` is held as a plain ``ndarray`` view of the same mapping (nothing
       copied): the memmap subclass's ``__array_finalize__`` on each slice made a 49k-token
       vocabulary take 2.4 s to parse, a plain view a third of that.
    2. Arrays are split into the package's own ``ReaderField`` parts in one pass instead of one
       recursive call and typed numpy view per element (a vocabulary's tokens, scores, token
       types and merges are ~250k elements): a scalar array is one view of all its values (what
       ``ReaderField.contents()`` flattens anyway), a string array gets per-string parts as plain
       uint8 slices of the mapping (``nbytes`` and ``tobytes()``, all ``contents()`` uses).
       ``test_gguf_reader.py`` compares every field with the stock reader's.
    """
    from gguf import GGUFReader, GGUFValueType
    from gguf.gguf_reader import ReaderField

    class FastArrayReader(GGUFReader):
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
                raise _Malformed(
                    f"{where}{need} bytes at byte {offset} run past the end of the file "
                    f"({self._plain.nbytes} bytes): truncated or corrupt"
                )
            return super()._get(offset, dtype, count, override_order)

        def _get_str(self, offset: int) -> tuple[np.ndarray, np.ndarray]:
            slen = self._get(offset, np.uint64)
            length, left = int(slen[0]), self._left(offset + 8)
            if length > left:
                raise _Malformed(
                    f"a string at byte {offset} claims {length} bytes; {left} are left in the "
                    "file (truncated or corrupt)"
                )
            return slen, self._get(offset + 8, np.uint8, length)

        def _value_type(self, raw: Any) -> Any:
            try:
                return GGUFValueType(int(raw))
            except ValueError:
                raise _Malformed(f"has value type {int(raw)}, which GGUF does not define") from None

        def _build_fields(self, offs: int, count: Any) -> int:
            count, left = int(count), self._left(offs)
            if count > left // _MIN_KV_BYTES:
                raise _Malformed(
                    f"GGUF.kv_count is {count}; the {left} bytes after the header hold at most "
                    f"{left // _MIN_KV_BYTES} entries"
                )
            for i in range(count):
                start = offs
                try:
                    klen, kdata = self._get_str(offs)
                    key = bytes(kdata).decode("utf-8")
                except (_Malformed, UnicodeDecodeError) as exc:
                    raise _Malformed(f"metadata entry {i} of {count}: its key: {exc}") from None
                offs += 8 + int(kdata.nbytes)
                try:
                    raw_type = self._get(offs, np.uint32)
                    size, parts, idxs, types = self._get_field_parts(offs + 4, raw_type[0])
                except _Malformed as exc:
                    raise _Malformed(f"{key}: {exc}") from None
                if key in self.fields:
                    raise _Malformed(f"{key} appears twice in the metadata")
                self.fields[key] = ReaderField(
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
                raise _Malformed(
                    f"an array of {count} {itype.name.lower()} values needs at least "
                    f"{count * least} bytes; {self._left(offs)} are left in the file"
                )
            if nptype is not None:
                values = self._get(offs, nptype, count)
                return 12 + int(values.nbytes), [raw_itype, alen, values], [2], types
            if itype == GGUFValueType.STRING:
                end, strings, idxs = _string_parts(self, orig_offs, count)
                return end - orig_offs, [raw_itype, alen, *strings], [2 + i for i in idxs], types
            if depth + 1 >= MAX_ARRAY_DEPTH:
                raise _Malformed(f"arrays nest deeper than {MAX_ARRAY_DEPTH} levels")
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
                raise _Malformed(f"a tensor name at byte {orig_offs} is not UTF-8") from None
            offs = orig_offs + 8 + int(name_data.nbytes)
            try:
                n_dims = self._get(offs, np.uint32)
                if not 1 <= int(n_dims[0]) <= MAX_DIMS:
                    raise _Malformed(f"has {int(n_dims[0])} dimensions (ggml allows 1 to 4)")
                dims = self._get(offs + 4, np.uint64, n_dims[0])
                offs += 4 + int(dims.nbytes)
                raw_dtype, offset = self._get(offs, np.uint32), self._get(offs + 4, np.uint64)
            except _Malformed as exc:
                raise _Malformed(f"tensor {name}: {exc}") from None
            parts = [name_len, name_data, n_dims, dims, raw_dtype, offset]
            return ReaderField(orig_offs, name, parts, [1, 3, 4, 5])

        def _build_tensor_info(self, offs: int, count: Any) -> tuple[int, list]:
            count, left = int(count), self._left(offs)
            if count > left // _MIN_TENSOR_INFO_BYTES:
                raise _Malformed(
                    f"GGUF.tensor_count is {count}; the {left} bytes after the metadata hold at "
                    f"most {left // _MIN_TENSOR_INFO_BYTES} tensor entries"
                )
            return super()._build_tensor_info(offs, count)

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            _check_tensor_spans(fields, start_offs, int(self._plain.nbytes), int(self.alignment))
            super()._build_tensors(start_offs, fields)

    return FastArrayReader


def _string_parts(
    reader: Any, orig_offs: int, count: int
) -> tuple[int, list[np.ndarray], list[int]]:
    """The ``count`` strings of the array whose header is at ``orig_offs``: (the offset after
    them, each string's length and bytes as parts, the index of each string's bytes part)."""
    data, byte_order = reader._plain, reader.byte_order
    mem = memoryview(data)
    swapped = {"little": "big", "big": "little"}[sys.byteorder]
    order = sys.byteorder if byte_order == "I" else swapped
    parts: list[np.ndarray] = []
    idxs: list[int] = []
    offs = orig_offs + 12
    for i in range(count):
        end = offs + 8 + int.from_bytes(mem[offs : offs + 8], order)
        if end > len(mem) or offs + 8 > len(mem):
            raise _Malformed(
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
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    section = file_size - start
    spans: list[tuple[int, int, str]] = []
    for field in fields:
        name = field.name
        _, _, _, dims, raw_dtype, offset = field.parts
        try:
            qtype = GGMLQuantizationType(int(raw_dtype[0]))
        except ValueError:
            raise _Malformed(
                f"{name} has type {int(raw_dtype[0])}, which ggml does not define"
            ) from None
        if qtype not in GGML_QUANT_SIZES:
            raise _Malformed(f"{name} has type {qtype.name}, whose block size ggml does not give")
        shape = [int(d) for d in dims]  # ggml's order: the first is contiguous
        if any(d <= 0 for d in shape):
            raise _Malformed(f"{name} has shape {shape} (every dimension must be positive)")
        block, type_size = GGML_QUANT_SIZES[qtype]
        if shape[0] % block:
            raise _Malformed(
                f"{name} of type {qtype.name} has {shape[0]} columns, not a multiple of its "
                f"block of {block}"
            )
        nbytes = math.prod(shape) // block * type_size
        rel = int(offset[0])
        if rel % alignment:
            raise _Malformed(f"{name}'s data offset {rel} is not a multiple of {alignment}")
        if rel + nbytes > section:
            raise _Malformed(
                f"{name} needs {nbytes} bytes at offset {rel} of the data section, which holds "
                f"{max(section, 0)} bytes: the file is truncated or the offset is wrong"
            )
        spans.append((rel, rel + nbytes, name))
    spans.sort()
    for (_, end, before), (begin, _, after) in itertools.pairwise(spans):
        if begin < end:
            raise _Malformed(f"{after}'s data (from offset {begin}) overlaps {before}'s")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's entry: ggml's shape is reversed into PyTorch's ``[rows, columns]``."""

    name: str
    type_name: str  # ggml's name: "Q4_K", "F32", ...
    shape: tuple[int, ...]  # PyTorch order: the last dimension is contiguous
    raw: np.ndarray  # the bytes (or float elements) as the reader maps them
    qtype: Any  # gguf.GGMLQuantizationType
    path: Path | None = None
    offset: int = 0  # of the data in the file

    def read(self) -> np.ndarray:
        """The data as :attr:`raw` holds it, read into a fresh buffer with plain file reads.

        Loading reads every tensor once and converts it; read through the memory map, each
        page of the file would stay in this process's resident set until the map closes (the
        whole file, on top of the converted weights, at the peak).
        """
        if self.path is None:
            return np.asarray(self.raw)
        buf = np.empty(self.raw.shape, dtype=self.raw.dtype)
        with self.path.open("rb", buffering=0) as f:
            self.read_into(f, 0, buf)
        return buf

    def read_into(self, f: Any, start: int, out: np.ndarray) -> None:
        """``out.nbytes`` bytes of the data from byte ``start`` into ``out`` (contiguous), by
        plain reads of the open file ``f``."""
        f.seek(self.offset + start)
        view = memoryview(out.reshape(-1).view(np.uint8))
        while view.nbytes:
            got = f.readinto(view)
            if not got:
                raise GGUFFileError(f"{self.path}: tensor {self.name!r} is cut short")
            view = view[got:]


class GGUFFile:
    """A parsed GGUF file: ``metadata(key)``, ``tensors`` by name, ``architecture``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.is_file():
            raise GGUFFileError(f"{path}: no such GGUF file")
        try:
            reader = _reader_class()(str(path))
        except _Malformed as exc:
            raise GGUFFileError(f"{path}: {_one_line(exc)}") from None
        except (ValueError, IndexError, KeyError, OSError, TypeError) as exc:
            raise GGUFFileError(
                f"{path}: not a readable GGUF file ({_one_line(exc)}); truncated or corrupt?"
            ) from exc
        self._reader = reader
        self.tensors: dict[str, GGUFTensor] = {}
        for t in reader.tensors:  # each checked by the reader (_check_tensor_spans)
            shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
            name = getattr(t.tensor_type, "name", str(t.tensor_type))
            self.tensors[t.name] = GGUFTensor(
                t.name, name, shape, t.data, t.tensor_type, self.path, int(t.data_offset)
            )

    @property
    def file_size(self) -> int:
        return int(self._reader._plain.nbytes)

    @property
    def metadata_bytes(self) -> memoryview:
        """The header and metadata (everything before the tensor data), for cache keys."""
        return memoryview(self._reader._plain[: int(self._reader.data_offset)])

    def has(self, key: str) -> bool:
        return key in self._reader.fields

    def metadata(self, key: str, default: Any = _MISSING) -> Any:
        """A metadata value as Python (str, int, float, bool or list); ``default`` if absent.

        Without a default a missing key is a ``GGUFFileError`` naming the file and the key.
        """
        field = self._reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise GGUFFileError(f"{self.path}: metadata field {key!r} is missing")
            return default
        try:
            return field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise GGUFFileError(
                f"{self.path}: metadata field {key!r} cannot be read ({_one_line(exc)})"
            ) from exc

    def array_length(self, key: str) -> int | None:
        """How many elements the array ``key`` holds (None if absent or not an array),
        without converting them."""
        field = self._reader.fields.get(key)
        if field is None or len(field.types) < 1 or field.types[0].name != "ARRAY":
            return None
        return int(field.parts[4][0])  # key length, key, type, item type, count

    @property
    def architecture(self) -> str:
        arch = self.metadata("general.architecture")
        if not isinstance(arch, str):
            raise GGUFFileError(f"{self.path}: general.architecture is not a string")
        return arch


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def gguf_path_of(model: str | Path) -> Path | None:
    """The GGUF file a model argument names: the file itself, or a folder's one ``.gguf`` when
    the folder has no ``config.json``; None for a Hugging Face folder.

    A folder holding several ``.gguf`` files (split or alternative quantisations) is refused
    with the list, rather than picking one silently.
    """
    path = Path(model)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ValueError(f"model: {str(path)!r} does not exist")
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf")
    if len(found) > 1:
        raise ValueError(
            f"model: {str(path)!r} holds several GGUF files ({', '.join(p.name for p in found)});"
            " name the one to load"
        )
    return found[0] if found else None

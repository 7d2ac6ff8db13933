"""Opening a GGUF file with ggml's own ``gguf`` package, and reading its metadata.

The file is memory-mapped by ``gguf.GGUFReader``; tensor data stays in the page cache until a
tensor is converted. Every error names the file and, where there is one, the field or tensor:
a truncated or corrupt file must fail at start-up with one line, never load wrong weights.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pagedllm.models.safetensors_reader import CheckpointError

logger = logging.getLogger(__name__)

_MISSING = object()


def _reader_class() -> type:
    """``gguf.GGUFReader`` with two costs of its metadata parse taken out.

    1. Its ``np.memmap`` is held as a plain ``ndarray`` view of the same mapping (nothing
       copied): the memmap subclass's ``__array_finalize__`` on each slice made a 49k-token
       vocabulary take 2.4 s to parse, a plain view a third of that.
    2. Arrays are split into the package's own ``ReaderField`` parts in one pass instead of one
       recursive call and typed numpy view per element (a vocabulary's tokens, scores, token
       types and merges are ~250k elements): a scalar array is one view of all its values (what
       ``ReaderField.contents()`` flattens anyway), a string array gets per-string parts as plain
       uint8 slices of the mapping (``nbytes`` and ``tobytes()``, all ``contents()`` uses).
       Nested arrays keep the package's walk. ``test_gguf_reader.py`` compares every field with
       the stock reader's.
    """
    from gguf import GGUFReader, GGUFValueType

    class FastArrayReader(GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain = np.asarray(value).view(np.ndarray)

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple:
            if raw_type != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            if raw_itype.size != 1 or alen.size != 1:
                raise ValueError(f"array header at offset {orig_offs} runs past the end")
            itype, count, offs = GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
            types = [GGUFValueType.ARRAY, itype]
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is not None:
                values = self._get(offs, nptype, count)
                if values.size != count:
                    raise ValueError(f"array at offset {orig_offs} runs past the end")
                return 12 + int(values.nbytes), [raw_itype, alen, values], [2], types
            if itype != GGUFValueType.STRING:
                return super()._get_field_parts(orig_offs, raw_type)
            end, strings, idxs = _string_parts(self._plain, self.byte_order, orig_offs, count)
            return end - orig_offs, [raw_itype, alen, *strings], [2 + i for i in idxs], types

    return FastArrayReader


def _string_parts(
    data: np.ndarray, byte_order: str, orig_offs: int, count: int
) -> tuple[int, list[np.ndarray], list[int]]:
    """The ``count`` strings of the array whose header is at ``orig_offs``: (the offset after
    them, each string's length and bytes as parts, the index of each string's bytes part)."""
    mem = memoryview(data)
    swapped = {"little": "big", "big": "little"}[sys.byteorder]
    order = sys.byteorder if byte_order == "I" else swapped
    parts: list[np.ndarray] = []
    idxs: list[int] = []
    offs = orig_offs + 12
    for _ in range(count):
        end = offs + 8 + int.from_bytes(mem[offs : offs + 8], order)
        if end > len(mem):
            raise ValueError(f"string array at offset {orig_offs} runs past the end")
        # Plain ndarray slices (uint8; the length too): unlike memoryviews they are not tracked
        # by the garbage collector, and the parsed file stays cached (loading.open_gguf): 200k
        # tracked objects slowed every full collection.
        parts += (data[offs : offs + 8], data[offs + 8 : end])
        idxs.append(len(parts) - 1)
        offs = end
    return offs, parts, idxs


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
                raise CheckpointError(f"{self.path}: tensor {self.name!r} is cut short")
            view = view[got:]


class GGUFFile:
    """A parsed GGUF file: ``metadata(key)``, ``tensors`` by name, ``architecture``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.is_file():
            raise CheckpointError(f"{path}: no such GGUF file")
        try:
            reader = _reader_class()(str(path))
        except (ValueError, IndexError, KeyError, OSError, TypeError) as exc:
            raise CheckpointError(
                f"{path}: not a readable GGUF file ({_one_line(exc)}); truncated or corrupt?"
            ) from exc
        self._reader = reader
        self.tensors: dict[str, GGUFTensor] = {}
        for t in reader.tensors:
            self.tensors[t.name] = self._checked_tensor(t)

    def _checked_tensor(self, t: Any) -> GGUFTensor:
        from gguf import GGML_QUANT_SIZES

        qtype = t.tensor_type
        name = getattr(qtype, "name", str(qtype))
        shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
        if qtype not in GGML_QUANT_SIZES:
            raise CheckpointError(f"{self.path}: tensor {t.name!r} has unknown type {name}")
        block, type_size = GGML_QUANT_SIZES[qtype]
        elements = int(np.prod(shape)) if shape else 1
        if shape and shape[-1] % block:
            raise CheckpointError(
                f"{self.path}: tensor {t.name!r} of type {name} has {shape[-1]} columns, "
                f"not a multiple of its block of {block}"
            )
        expected = elements // block * type_size
        if int(t.data.nbytes) != expected or int(t.data_offset) + expected > self.file_size:
            raise CheckpointError(
                f"{self.path}: tensor {t.name!r} needs {expected} bytes at offset "
                f"{int(t.data_offset)}, past the end of the file ({self.file_size} bytes): "
                "the file is truncated"
            )
        return GGUFTensor(t.name, name, shape, t.data, qtype, self.path, int(t.data_offset))

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

        Without a default a missing key is a ``CheckpointError`` naming the file and the key.
        """
        field = self._reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise CheckpointError(f"{self.path}: metadata field {key!r} is missing")
            return default
        try:
            return field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise CheckpointError(
                f"{self.path}: metadata field {key!r} cannot be read ({_one_line(exc)})"
            ) from exc

    @property
    def architecture(self) -> str:
        arch = self.metadata("general.architecture")
        if not isinstance(arch, str):
            raise CheckpointError(f"{self.path}: general.architecture is not a string")
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

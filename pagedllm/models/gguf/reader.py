"""Opening a GGUF file, and reading its metadata.

The file is memory-mapped by our own header parser (``bounded_reader.GGUFHeader``: ggml's
``gguf`` package costs 0.2-0.3 s to import); tensor data stays in the page cache until a
tensor is converted. Every error names the file and, where there is one, the field or tensor:
a truncated or corrupt file must fail at start-up with one line, never load wrong weights.
"""

from __future__ import annotations

import functools
import logging
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


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's entry: ggml's shape is reversed into PyTorch's ``[rows, columns]``."""

    name: str
    type_name: str  # ggml's name: "Q4_K", "F32", ...
    shape: tuple[int, ...]  # PyTorch order: the last dimension is contiguous
    raw: np.ndarray  # the bytes (or float elements) as the reader maps them
    qtype: Any  # ggml_types.GGMLType (an IntEnum: gguf.GGMLQuantizationType's numbers)
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
        from pagedllm.models.gguf.bounded_reader import GGUFHeader, Malformed

        try:
            reader = GGUFHeader(path)
        except Malformed as exc:
            raise GGUFFileError(f"{path}: {_one_line(exc)}") from None
        except (ValueError, IndexError, KeyError, OSError, TypeError) as exc:
            raise GGUFFileError(
                f"{path}: not a readable GGUF file ({_one_line(exc)}); truncated or corrupt?"
            ) from exc
        self._reader = reader
        self.tensors: dict[str, GGUFTensor] = {}
        for t in reader.tensors:  # each checked by the reader (GGUFHeader._build_tensors)
            self.tensors[t.name] = GGUFTensor(
                t.name, t.qtype.name, t.dims[::-1], t.data, t.qtype, self.path, t.data_offset
            )

    @property
    def file_size(self) -> int:
        return self._reader.size

    @property
    def metadata_bytes(self) -> memoryview:
        """The header and metadata (everything before the tensor data), for cache keys."""
        return memoryview(self._reader.mapped[: self._reader.data_offset])

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
        return None if field is None else field.count

    @property
    def architecture(self) -> str:
        arch = self.metadata("general.architecture")
        if not isinstance(arch, str):
            raise GGUFFileError(f"{self.path}: general.architecture is not a string")
        return arch


@functools.lru_cache(maxsize=2)
def _open(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(Path(path))


def open_gguf(path: Path) -> GGUFFile:
    """The parsed file, parsed once per process while it is unchanged (config, tokenizer and
    weights are read at different moments of one engine start; parsing takes ~0.1-1 s)."""
    stat = path.stat()
    return _open(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


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

"""What a parsed GGUF header hands out: metadata ``Field``s and ``TensorInfo``s.

Apart from the parser because these outlive the parse and are what its callers hold: a value
stays where it lies in the memory map until its contents are asked for (a cached tokenizer
never asks, and a vocabulary decoded string by string cost 0.3-0.4 s of every start), and a
tensor's data is a numpy view of the same map. None of this checks bounds: the parser has
checked every span before building a holder over it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedllm.models.gguf.ggml_types import GGMLType, ValueType


class Text:
    """A metadata string: where its bytes lie in the map, decoded when asked."""

    __slots__ = ("end", "mapped", "start")

    def __init__(self, mapped: np.ndarray, start: int, end: int) -> None:
        self.mapped, self.start, self.end = mapped, start, end

    def value(self) -> str:
        return self.mapped[self.start : self.end].tobytes().decode("utf-8")


class Texts:
    """An array of strings: where each one's bytes start and end in the map (int64), decoded
    when asked (a cached tokenizer never asks: a 49k-token vocabulary and its merges decoded
    string by string were 0.3-0.4 s of every start)."""

    __slots__ = ("ends", "mapped", "starts")

    def __init__(self, mapped: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        self.mapped, self.starts, self.ends = mapped, starts, ends

    def leaves(self, pick: int | slice = slice(None)) -> Any:
        if isinstance(pick, int):
            return self.mapped[int(self.starts[pick]) : int(self.ends[pick])].tobytes().decode()
        starts, ends = self.starts[pick], self.ends[pick]
        if not len(starts):
            return []
        base = int(starts.min())
        block = self.mapped[base : int(ends.max())].tobytes()  # one copy, then slices of it
        return [
            block[s - base : e - base].decode("utf-8")
            for s, e in zip(starts.tolist(), ends.tolist(), strict=True)
        ]


class Numbers:
    """An array of fixed-size values: one numpy view of the map."""

    __slots__ = ("values",)

    def __init__(self, values: np.ndarray) -> None:
        self.values = values

    def leaves(self, pick: int | slice = slice(None)) -> Any:
        return self.values[pick].tolist()


class Nested:
    """An array of arrays: its values are the inner arrays' values in a row (the stock
    reader's flattening; llama.cpp writes no nested arrays)."""

    __slots__ = ("inner",)

    def __init__(self, inner: list[Numbers | Texts | Nested]) -> None:
        self.inner = inner

    def leaves(self, pick: int | slice = slice(None)) -> Any:
        flat = [v for array in self.inner for v in array.leaves()]
        return flat[pick]


Array = Numbers | Texts | Nested


@dataclass(frozen=True)
class Field:
    """One metadata entry: ``types`` as the stock reader lists them (the value's type; for an
    array ``ARRAY``, then its first element's types), ``count`` an array's length."""

    offset: int  # of the entry (its key's length) in the file
    name: str
    types: list[ValueType]
    value: Any  # a Python scalar, or a Text or array holder
    count: int | None = None  # elements of an array; None for a scalar

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        """The value as Python (an array: all of it, one element or a slice of it)."""
        if self.count is not None:
            return self.value.leaves(index_or_slice)
        if isinstance(self.value, Text):
            return self.value.value()
        return self.value


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry, checked against the file, and its data as a view of the map."""

    name: str
    qtype: GGMLType
    dims: tuple[int, ...]  # ggml's order: the first is contiguous
    offset: int  # in the data section, as the entry gives it
    data_offset: int  # in the file
    data: np.ndarray  # elements (float and int types) or bytes, shaped in numpy's order
    entry_offset: int  # of the entry in the file

    @property
    def n_bytes(self) -> int:
        return int(self.data.nbytes)

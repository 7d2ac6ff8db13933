"""The GGUF specification's value types and ggml's tensor types, as our own tables.

Kept apart from the parser because they are data, not parsing: the parser, the value holders
and the tests (which compare them with the ``gguf`` package's, name by name) read them, and
they change only when ggml numbers a new type, never when the parser's checks do.
"""

from __future__ import annotations

import struct
from enum import IntEnum

import numpy as np


class ValueType(IntEnum):
    """A metadata value's type, as the GGUF specification numbers it."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# The fixed-size value types: how one is unpacked, and the numpy type of an array of them.
SCALARS: dict[ValueType, tuple[struct.Struct, np.dtype]] = {
    t: (struct.Struct("<" + code), np.dtype("<" + code))
    for t, code in (
        (ValueType.UINT8, "B"),
        (ValueType.INT8, "b"),
        (ValueType.UINT16, "H"),
        (ValueType.INT16, "h"),
        (ValueType.UINT32, "I"),
        (ValueType.INT32, "i"),
        (ValueType.FLOAT32, "f"),
        (ValueType.BOOL, "?"),
        (ValueType.UINT64, "Q"),
        (ValueType.INT64, "q"),
        (ValueType.FLOAT64, "d"),
    )
}


class GGMLType(IntEnum):
    """A tensor's type, as ggml numbers it (``ggml_type``; 4, 5 and 31-33 were removed)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41


_K = 256  # the super-block of the K and IQ types
# (elements per block, bytes per block) of each type: the layouts of ggml-common.h's blocks.
BLOCK_SIZES: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.Q4_0: (32, 2 + 16),
    GGMLType.Q4_1: (32, 2 + 2 + 16),
    GGMLType.Q5_0: (32, 2 + 4 + 16),
    GGMLType.Q5_1: (32, 2 + 2 + 4 + 16),
    GGMLType.Q8_0: (32, 2 + 32),
    GGMLType.Q8_1: (32, 4 + 4 + 32),
    GGMLType.Q2_K: (_K, 2 + 2 + _K // 16 + _K // 4),
    GGMLType.Q3_K: (_K, 2 + _K // 4 + _K // 8 + 12),
    GGMLType.Q4_K: (_K, 2 + 2 + _K // 2 + 12),
    GGMLType.Q5_K: (_K, 2 + 2 + _K // 2 + _K // 8 + 12),
    GGMLType.Q6_K: (_K, 2 + _K // 2 + _K // 4 + _K // 16),
    GGMLType.Q8_K: (_K, 4 + _K + _K // 8),
    GGMLType.IQ2_XXS: (_K, 2 + _K // 4),
    GGMLType.IQ2_XS: (_K, 2 + _K // 4 + _K // 32),
    GGMLType.IQ3_XXS: (_K, 2 + _K // 4 + _K // 8),
    GGMLType.IQ1_S: (_K, 2 + _K // 8 + _K // 16),
    GGMLType.IQ4_NL: (32, 2 + 16),
    GGMLType.IQ3_S: (_K, 2 + _K // 4 + _K // 8 + _K // 32 + 4),
    GGMLType.IQ2_S: (_K, 2 + _K // 4 + _K // 16),
    GGMLType.IQ4_XS: (_K, 2 + 2 + _K // 2 + _K // 64),
    GGMLType.I8: (1, 1),
    GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.I64: (1, 8),
    GGMLType.F64: (1, 8),
    GGMLType.IQ1_M: (_K, _K // 8 + _K // 16 + _K // 32),
    GGMLType.BF16: (1, 2),
    GGMLType.TQ1_0: (_K, 2 + 4 * 13),
    GGMLType.TQ2_0: (_K, 2 + 64),
    GGMLType.MXFP4: (32, 1 + 16),
    GGMLType.NVFP4: (64, 4 + 32),
    GGMLType.Q1_0: (128, 2 + 16),
}
# The types whose data is handed out as elements (the rest as bytes, one row of blocks a row).
ELEMENTS = {
    GGMLType.F32: np.dtype("<f4"),
    GGMLType.F16: np.dtype("<f2"),
    GGMLType.F64: np.dtype("<f8"),
    GGMLType.I8: np.dtype("i1"),
    GGMLType.I16: np.dtype("<i2"),
    GGMLType.I32: np.dtype("<i4"),
    GGMLType.I64: np.dtype("<i8"),
}

"""The numpy definitions of GGUF's block layouts: a quantised tensor's raw blocks -> the arrays
of the group-wise format it is kept in (q and its factors, bit for bit), or float32 values.

A device backend may decode the same blocks with its own kernel (``BlockDecoder`` in
:mod:`.weights`); these definitions are what such a kernel must reproduce.
"""

from __future__ import annotations

import numpy as np

from pagedllm.models.gguf.reader import GGUFTensor
from pagedllm.models.safetensors_reader import CheckpointError


def _blocks(tensor: GGUFTensor, type_size: int) -> np.ndarray:
    """The raw bytes as ``[rows, blocks, type_size]`` uint8."""
    rows = int(np.prod(tensor.shape[:-1])) if len(tensor.shape) > 1 else 1
    return tensor.read().view(np.uint8).reshape(rows, -1, type_size)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of every block, widened: ``[rows, blocks]`` float32."""
    return (
        np.ascontiguousarray(blocks[..., start : start + 2])
        .view(np.float16)[..., 0]
        .astype(np.float32)
    )


def _nibbles_low_high(qs: np.ndarray) -> np.ndarray:
    """ggml's 4-bit order (16 bytes: elements 0-15 low nibbles, 16-31 high) -> ``[..., 32]``."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def int4_groups(tensor: GGUFTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0 / Q4_1 / Q4_K tensor -> (nibbles uint8 ``[N, K/2]`` in the layout of
    :func:`~pagedllm.layers.quantization.groupwise.pack_nibbles`, scale, offset ``[N, K/32]``).

    ``q * scale + offset`` is ggml's dequantisation, rounding included: each product here is
    exact in float32, so the same single rounding happens in the sum.
    """
    kind = tensor.type_name
    if kind == "Q4_0":
        blocks = _blocks(tensor, 18)
        d = _f16(blocks, 0)
        q = _nibbles_low_high(blocks[..., 2:])
        scale, offset = d, d * np.float32(-8)
    elif kind == "Q4_1":
        blocks = _blocks(tensor, 20)
        scale, offset = _f16(blocks, 0), _f16(blocks, 2)
        q = _nibbles_low_high(blocks[..., 4:])
    elif kind == "Q4_K":
        from gguf.quants import Q4_K

        blocks = _blocks(tensor, 144)
        rows, supers = blocks.shape[:2]
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, mins = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
        sc = sc.reshape(rows, supers, 8).astype(np.float32)
        mins = mins.reshape(rows, supers, 8).astype(np.float32)
        scale = (d[..., None] * sc).reshape(rows, -1)
        offset = -(dmin[..., None] * mins).reshape(rows, -1)
        # 128 bytes per super-block: 4 runs of 32 bytes, low nibbles then high nibbles.
        qs = blocks[..., 16:].reshape(rows, supers, 4, 1, 32)
        q = np.concatenate((qs & 0x0F, qs >> 4), axis=3)  # [rows, supers, 4, 2, 32]
    else:
        raise CheckpointError(f"tensor {tensor.name!r}: {kind} is not a 4-bit group type")
    rows = blocks.shape[0]
    q = q.reshape(rows, -1)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)  # numpy: ~20x PyTorch's strided uint8 ops
    return packed, scale.reshape(rows, -1), offset.reshape(rows, -1)


# ggml's IQ4_NL / IQ4_XS levels (``kvalues_iq4nl``).
_IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])
_IQ4_LEVELS = _IQ4_LEVELS.astype(np.int8)


def int8_groups(tensor: GGUFTensor) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 / Q5_0 / IQ4_NL / IQ4_XS tensor -> (q int8 ``[N, K]``, scale ``[N, K/32]``).

    ``q * scale`` is ggml's dequantisation, rounding included: Q8_0 and Q5_0 are ``q * d``,
    IQ4_NL ``d * kv[q]``, IQ4_XS ``dl * kv[q]`` with ``dl = d * (ls - 32)`` exact in float32.
    """
    kind = tensor.type_name
    if kind == "Q8_0":
        blocks = _blocks(tensor, 34)
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
        scale = _f16(blocks, 0)
    elif kind == "Q5_0":  # d, 32 high bits (one per weight), 16 bytes of low nibbles
        blocks = _blocks(tensor, 22)
        scale = _f16(blocks, 0)
        qh = np.ascontiguousarray(blocks[..., 2:6]).view(np.uint32)  # [rows, blocks, 1]
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # weight j: bit j
        q = (_nibbles_low_high(blocks[..., 6:]) | (high << 4)).astype(np.int8) - np.int8(16)
    elif kind == "IQ4_NL":  # d, 16 bytes of level indices
        blocks = _blocks(tensor, 18)
        scale = _f16(blocks, 0)
        q = _IQ4_LEVELS[_nibbles_low_high(blocks[..., 2:])]
    elif kind == "IQ4_XS":  # per 256: d, ls' high bits, ls' low nibbles, 8 groups x 16 bytes
        blocks = _blocks(tensor, 136)
        rows, supers = blocks.shape[:2]
        d = _f16(blocks, 0)
        high = np.ascontiguousarray(blocks[..., 2:4]).view(np.uint16)  # group j: bits 2j, 2j+1
        high = (high >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [rows, supers, 8]
        low = blocks[..., 4:8]  # group 2i: low nibble of byte i, 2i + 1: high nibble
        low = np.stack((low & 0x0F, low >> 4), axis=-1).reshape(rows, supers, 8)
        ls = (low | (high.astype(np.uint8) << 4)).astype(np.float32) - np.float32(32)
        scale = (d[..., None] * ls).reshape(rows, -1)  # exact: 11 by 6 significant bits
        q = _IQ4_LEVELS[_nibbles_low_high(blocks[..., 8:].reshape(rows, supers, 8, 16))]
    else:
        raise CheckpointError(f"tensor {tensor.name!r}: {kind} is not an 8-bit group type")
    rows = q.shape[0]
    return np.ascontiguousarray(q).reshape(rows, -1), scale.reshape(rows, -1)


_Q6_K_BYTES = 210  # ql 128, qh 64, sc 16 (int8), d 2 (fp16) per super-block of 256
_Q6_K_ROWS = 4096  # rows decoded at a time: an LM head's uint8 temporaries stay ~100 MB


def q6_k_groups(tensor: GGUFTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q6_K tensor -> (q - 32 int8 ``[N, K]``, scale ``d * sc`` ``[N, K/16]``, d ``[N, K/256]``);
    a Q3_K one in the same form (:func:`q3_k_groups`).

    ggml's dequantisation is ``fl32(d * sc) * (q - 32)``: ``d * sc`` is exact in float32 (11 by
    8 significant bits), so ``dequantize_int8_groups(q, scale)`` rounds as ggml does.
    """
    if tensor.type_name == "Q3_K":
        return q3_k_groups(tensor)
    blocks = _blocks(tensor, _Q6_K_BYTES)
    rows, supers = blocks.shape[:2]
    d = _f16(blocks, 208)  # [rows, supers]
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    scale = (d[..., None] * sc).reshape(rows, -1)
    q = np.empty((rows, supers * 256), dtype=np.int8)
    for r0 in range(0, rows, _Q6_K_ROWS):
        q[r0 : r0 + _Q6_K_ROWS] = _q6_k_values(blocks[r0 : r0 + _Q6_K_ROWS])
    return q, scale, d


_Q5_K_BYTES = 176  # d, dmin (fp16), 12 bytes of 6-bit sc and m, qh 32, qs 128 per 256


def q5_k_groups(tensor: GGUFTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q5_K tensor -> (q int8 ``[N, K]`` in 0..31, scale ``d * sc``, offset ``-dmin * m``
    ``[N, K/32]``): ggml's dequantisation ``(d * sc) * q - dmin * m`` with both products exact
    in float32 (11 + 6 + 5 significant bits), so ``q * scale + offset`` rounds as it does.

    Group ``g`` (of 8 per super-block) and weight ``i``: the low nibble of qs byte
    ``32 (g // 2) + i`` (odd groups: the high nibble), its fifth bit at bit ``g`` of qh byte
    ``i``; sc and m packed as Q4_K's.
    """
    from gguf.quants import Q4_K

    blocks = _blocks(tensor, _Q5_K_BYTES)
    rows, supers = blocks.shape[:2]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mins = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
    scale = (d[..., None] * sc.reshape(rows, supers, 8).astype(np.float32)).reshape(rows, -1)
    offset = -(dmin[..., None] * mins.reshape(rows, supers, 8).astype(np.float32))
    qs = blocks[..., 48:].reshape(rows, supers, 4, 1, 32)
    low = (qs >> np.array([[0], [4]], dtype=np.uint8)) & 0x0F  # [.., 4, 2, 32]: g = 2 j + h
    qh = blocks[..., 16:48].reshape(rows, supers, 1, 1, 32)
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(4, 2, 1)) & 1
    q = (low | (high << 4)).astype(np.int8).reshape(rows, -1)
    return q, scale, offset.reshape(rows, -1)


_Q3_K_BYTES = 110  # hmask 32, qs 64, 12 bytes of 6-bit scales, d 2 (fp16) per 256


def q3_k_groups(tensor: GGUFTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q3_K tensor in :func:`q6_k_groups`' form: (q int8 ``[N, K]`` in -4..3, scale
    ``d * (sc - 32)`` ``[N, K/16]``, d ``[N, K/256]``); ggml's dequantisation is
    ``fl32(d * (sc - 32)) * q``, the product exact in float32 as Q6_K's.

    Element ``e`` of a super-block (``i = e % 32``, ``j = e // 32``): its low two bits at bits
    ``2 (j % 4)`` of qs byte ``32 (j // 4) + i``, and 4 subtracted unless bit ``j`` of hmask
    byte ``i`` is set. Scale ``s`` (of 16): its low nibble in byte ``s % 8`` (``s >= 8``: the high
    nibble), its top two bits at bits ``2 (s // 4)`` of byte ``8 + s % 4``.
    """
    blocks = _blocks(tensor, _Q3_K_BYTES)
    rows, supers = blocks.shape[:2]
    d = _f16(blocks, 108)
    packed = blocks[..., 96:108]
    low = (packed[..., None, :8] >> np.array([[0], [4]], dtype=np.uint8)) & 0x0F  # [.., 2, 8]
    high = (packed[..., None, 8:] >> np.array([[0], [2], [4], [6]], dtype=np.uint8)) & 0x03
    sc = low.reshape(rows, supers, 16) | (high.reshape(rows, supers, 16) << 4)
    scale = (d[..., None] * (sc.astype(np.float32) - np.float32(32))).reshape(rows, -1)
    q = np.empty((rows, supers * 256), dtype=np.int8)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    for r0 in range(0, rows, _Q6_K_ROWS):
        part = blocks[r0 : r0 + _Q6_K_ROWS]
        n = part.shape[0]
        qs = part[..., 32:96].reshape(n, supers, 2, 1, 32)
        two = (qs >> shifts) & 0x03  # [.., half, 4, 32]: e = 128 half + 32 (j % 4) + i
        hmask = part[..., :32].reshape(n, supers, 1, 1, 32)
        bit = (hmask >> np.arange(8, dtype=np.uint8).reshape(2, 4, 1)) & 1  # j = 4 half + ..
        values = two.astype(np.int8) - ((bit ^ 1) << 2).astype(np.int8)
        q[r0 : r0 + _Q6_K_ROWS] = values.reshape(n, -1)
    return q, scale, d


def _q6_k_values(blocks: np.ndarray) -> np.ndarray:
    """``[rows, supers, 210]`` -> int8 ``[rows, supers * 256]``: q - 32 in element order.

    Each half super-block (128 elements) takes 64 bytes of ql and 32 of qh: element
    ``32 j + i`` (j in 0..3, i in 0..31) has its low nibble in ql byte ``32 (j % 2) + i``
    (j < 2: low nibble, else high) and its top two bits at bits ``2 j`` of qh byte ``i``.
    """
    rows, supers = blocks.shape[:2]
    ql = blocks[..., :128].reshape(rows, supers, 2, 1, 64)  # [.., half, 1, 64]
    low = (ql >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F  # [.., half, 2, 64]
    low = low.reshape(rows, supers, 2, 4, 32)  # j = 2 * (nibble) + byte // 32
    qh = blocks[..., 128:192].reshape(rows, supers, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 0x03
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)  # [.., half, 4, 32]
    return q.reshape(rows, -1)


def dequantized(tensor: GGUFTensor) -> np.ndarray:
    """float32 in the tensor's PyTorch shape: the float types (every file's norms) widened
    here, the others by ggml's own dequantisation (its ``gguf`` package, 0.2-0.3 s to import,
    is imported only then)."""
    raw = tensor.read()
    if tensor.type_name in ("F32", "F16"):
        values = raw.astype(np.float32, copy=False)
    elif tensor.type_name == "BF16":  # the high half of a float32's bits
        values = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        from gguf.quants import dequantize

        values = dequantize(raw, tensor.qtype)
    return np.asarray(values, dtype=np.float32).reshape(tensor.shape)

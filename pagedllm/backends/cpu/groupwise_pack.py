"""Group-wise layers' weights packed for the CPU's C++ GEMM (``csrc/gemm_q4_pack.cpp``): the
layout, and the smallest exact form of each layer's scales.

Each layer is packed once into panels of 16 output columns, one block per group holding its 4- or
8-bit q and its scales and offsets in the smallest form that is exact for the whole layer
(:func:`pack_groupwise`): 4.5 bits a weight for Q4_0 (no offsets), 4.625 for Q4_K (scales
factored per 8 groups, kept in a header per 8 blocks so that every block of q is cache-line
aligned), 5 for Q4_1 and int4 made at load (fp16), 8.5 for Q8_0, 8.625 for Q6_K (q - 32 as int8,
two scales per group factored as fp16 d per 8 groups times int8 sc: :func:`factor_q6_k`), or
6.625 for Q6_K where the build reads its q at 6 bits and the layer never takes the dot path
(:func:`six_bits`). A q8_0 layer whose every q is one of ggml's 16 IQ4 levels (GGUF IQ4_NL /
IQ4_XS) packs those q as 4-bit indices where it stays off the dot path (:func:`iq4_levels`):
4.5 bits a weight (5 with IQ4_XS's float32 scales), read through a look-up table as Q4_0's
nibbles are. :mod:`.groupwise_linear` runs the packed layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from pagedllm.layers.quantization.groupwise import GROUP_SIZE


@dataclass(frozen=True)
class PackedGroupwise:
    """One layer's packed weights and the format the kernels read them in."""

    packed: torch.Tensor  # uint8 [ceil(N/16), panel bytes]
    n: int
    k: int
    bits: int  # 4 or 8; 6: q6_k's q at 6 bits (never the dot path; AVX2 and AVX-512 builds)
    half_scales: bool  # scales and offsets (factored: d and dm) stored as fp16: exact here
    with_offset: bool  # 4-bit: offsets stored (else offset = -8 * scale for every group)
    # 4-bit: scale = d * sc, offset = dm * m per super-block of 8 groups; 8-bit: q6_k, a scale
    # d * sc per 16 k (sc a signed byte, d per super-block of 8 groups)
    factored: bool
    # 4-bit q indexing ggml's IQ4 levels (a q8_0 layer whose every q is one: IQ4_NL, IQ4_XS)
    levels: bool = False

    @property
    def name(self) -> str:
        if self.levels:
            return "iq4"
        if self.bits == 4:
            return "int4"
        if self.with_offset:
            return "q5_k"
        return "q6_k" if self.factored else "q8_0"

    @property
    def layout(self) -> tuple[int, int, int, bool, bool, bool, bool]:
        """What the kernels read these panels as: (n, k, bits, half_scales, with_offset,
        factored, levels); layers of one layout share their kernel paths."""
        fmt = (self.bits, self.half_scales, self.with_offset, self.factored, self.levels)
        return (self.n, self.k, *fmt)

    @property
    def bits_per_weight(self) -> float:
        """Bytes streamed per call (scales included) per weight, in bits."""
        return self.packed.numel() * 8 / (self.packed.shape[0] * 16 * self.k)

    def rows(self, ops: ModuleType, rows: torch.Tensor) -> torch.Tensor:
        """float32 rows ``rows`` of W read back from the panels (as the definition
        dequantises them)."""
        return ops.groupwise_weight_rows(
            self.packed,
            self.n,
            self.k,
            self.bits,
            self.half_scales,
            self.with_offset,
            self.factored,
            rows,
            self.levels,
        )

    def gemm(
        self,
        ops: ModuleType,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        dot: bool,
        rows_kernel: str = "split",
    ):
        """``ops.groupwise_gemm`` on these weights: ``x [T, K] -> [T, N]`` (``rows_kernel``:
        what few bf16 rows on a 4-bit layer run, ``ops.groupwise_bf16_rows_kernels()``)."""
        check_k(x, self.k)
        fmt = (self.bits, self.half_scales, self.with_offset, self.factored)
        return ops.groupwise_gemm(
            x, self.packed, self.n, *fmt, bias, dot, self.levels, rows_kernel=rows_kernel
        )


def check_k(x: torch.Tensor, k: int) -> None:
    """The kernel can only check x's K against the panel's size, and super-blocks of 2 groups
    make a K of 32 * (2j - 1) and one of 32 * 2j the same size: the layer checks it exactly."""
    if x.shape[-1] != k:
        raise ValueError(f"x: {x.shape[-1]} features for a layer of {k}")


_SUPER = 8  # groups per factored super-block
_UNITS = 63  # Q4_K's 6-bit sc and m: the largest group of a super-block is 63 units


def _exact_in_half(t: torch.Tensor) -> bool:
    return bool(torch.equal(t.half().float(), t))


def factor_super_blocks(
    scale: torch.Tensor, offset: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Q4_K's structure, where every super-block of 8 groups has it exactly: ``scale = d * sc``
    and ``offset = dm * m`` with ``d``, ``dm`` per super-block and integers ``sc``, ``m`` in
    0..255. Returns (float32 ``[N, G/8, 2]``: d, dm; uint8 ``[N, G, 2]``: sc, m) or None.

    ``d`` is taken as the super-block's largest magnitude over 63 (Q4_K's quantiser gives its
    largest group 63 units, and ``d * 63`` is exact in float32, so the division recovers ``d``);
    every product is then checked bit for bit.
    """
    n, g = scale.shape
    if g % _SUPER:
        return None
    factors, units = [], []
    for values in (scale, offset):
        blocks = values.reshape(n, g // _SUPER, _SUPER)  # [N, G/8, 8]
        top = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))  # [N, G/8, 1]
        d = top / _UNITS
        u = torch.round(torch.where(d != 0, blocks / d, torch.zeros_like(blocks)))
        if not bool(((u >= 0) & (u <= 255) & (d * u == blocks)).all()):
            return None
        factors.append(d.squeeze(-1))
        units.append(u.to(torch.uint8).reshape(n, g))
    return torch.stack(factors, dim=-1), torch.stack(units, dim=-1)


_Q6_K_SUBS = 16  # scales (of 16 k) per super-block of 256 k


def factor_q6_k(scale: torch.Tensor, d: torch.Tensor) -> torch.Tensor | None:
    """Q6_K's signed byte ``sc [N, K/16]`` with ``scale == d * sc`` bit for bit (``scale`` the
    products per 16 k, ``d [N, K/256]``), or None where some product is not so (then the layer
    cannot be packed). ``d == 0`` takes ``sc = 0``, exact where its products are all zero."""
    n, subs = scale.shape
    if subs % _Q6_K_SUBS or d.shape != (n, subs // _Q6_K_SUBS):
        return None
    dd = d.repeat_interleave(_Q6_K_SUBS, dim=-1)  # [N, K/16]
    sc = torch.round(torch.where(dd != 0, scale / dd, torch.zeros_like(scale)))
    if not bool(((sc >= -128) & (sc <= 127) & (dd * sc == scale)).all()):
        return None
    return sc.to(torch.int8)


def scale_format(
    scale: torch.Tensor, offset: torch.Tensor | None, *, bits: int = 4
) -> tuple[bool, bool]:
    """(half_scales, with_offset) for float32 ``scale``/``offset [N, K/32]`` stored per group:
    fp16 only where every value is exactly an fp16 (GGUF's Q4_0/Q4_1/Q8_0 d and m; not Q4_K's
    d * sc products), 4-bit offsets dropped only where all are exactly ``-8 * scale`` (Q4_0,
    symmetric int4); 8-bit ones (q5_k) always kept."""
    with_offset = offset is not None and (bits == 8 or not torch.equal(offset, scale * -8))
    half = _exact_in_half(scale) and (not with_offset or _exact_in_half(offset))
    return half, with_offset


def pack_groupwise(
    ops: ModuleType,
    weight: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    super_scale: torch.Tensor | None = None,
    *,
    six: bool = False,
    levels: bool = False,
    storage: Storage | None = None,
) -> PackedGroupwise:
    """Pack ``weight`` (uint8 nibbles ``[N, K/2]`` with ``offset``, or int8 ``[N, K]``) and its
    float32 ``scale``/``offset [N, K/32]`` for ``ops.groupwise_gemm``, in the smallest exact
    format: no offsets (Q4_0: 4.5 bits a weight), factored (Q4_K: 4.625), fp16 (Q4_1: 5, Q8_0:
    8.5), else float32 (6, 9). A q6_k layer (``scale [N, K/16]``, ``super_scale`` its ``d``)
    packs factored: 8.625 bits a weight, or 6.625 with ``six`` (q at 6 bits, for a layer that
    never takes the dot path); ValueError where ``scale`` is not ``d * sc``. ``levels``: an
    int8 ``weight`` of IQ4 levels (:func:`iq4_levels`) packed as 4-bit indices (4.5 bits a
    weight with fp16 scales, 5 with float32); ValueError where some q is not a level.
    ``storage``: where the panels go (see :data:`Storage`); else a tensor of their own."""
    if super_scale is not None:
        return _pack_q6_k(ops, weight, scale, super_scale, six=six, storage=storage)
    if levels:
        half, _ = scale_format(scale, None)
        n, k = weight.shape
        into = _into(ops, storage, n, k, 4, half, False, False, True)
        try:
            packed = ops.pack_groupwise(weight, scale, None, 4, half, False, None, None, True, into)
        except RuntimeError as exc:
            raise ValueError(f"weight: not IQ4 levels ({exc})") from exc
        return PackedGroupwise(packed, n, k, 4, half, False, False, levels=True)
    bits = 4 if weight.dtype == torch.uint8 else 8  # nibbles, or int8 (q5_k: with offsets)
    half, with_offset = scale_format(scale, offset, bits=bits)
    factors = factor_super_blocks(scale, offset) if with_offset and bits == 4 else None
    fac, idx = factors if factors is not None else (None, None)
    if fac is not None:
        half = _exact_in_half(fac)
    n, k = weight.shape[0], weight.shape[1] * (2 if bits == 4 else 1)
    into = _into(ops, storage, n, k, bits, half, with_offset, fac is not None, False)
    packed = ops.pack_groupwise(
        weight, scale, offset, bits, half, with_offset, fac, idx, False, into
    )
    return PackedGroupwise(packed, n, k, bits, half, with_offset, fac is not None)


# ``storage((panels, panel bytes))``: a contiguous uint8 tensor of that shape for a layer's
# panels to be packed into, or None for a tensor of their own (an MoE layer's experts share one
# buffer: fused_moe.StackStorage).
Storage = Callable[[tuple[int, int]], "torch.Tensor | None"]


def _into(
    ops: ModuleType,
    storage: Storage | None,
    n: int,
    k: int,
    bits: int,
    half: bool,
    with_offset: bool,
    factored: bool,
    levels: bool,
) -> torch.Tensor | None:
    if storage is None:
        return None
    per_panel = ops.groupwise_panel_bytes(k, bits, half, with_offset, factored, levels)
    return storage(((n + 15) // 16, per_panel))


# ggml's IQ4_NL / IQ4_XS levels (``kvalues_iq4nl``; GGUF's are held as q8_0 layers of them).
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def iq4_levels(name: str, weight: torch.Tensor, *, dot: bool) -> bool:
    """Whether a ``name`` layer of int8 ``weight`` packs its q at 4 bits as indices into the
    IQ4 levels: a q8_0 layer whose every q is one of them (an IQ4_NL / IQ4_XS tensor: 4.5-5 bits
    a weight streamed instead of 8.5-9) that never takes the dot path (its kernels read whole
    bytes; the float kernels and AVX2's int16 kernels look the indices up). The first row is
    sampled here (a Q8_0 layer fails it at once); the pack checks every value."""
    if name != "q8_0" or dot or weight.dtype != torch.int8 or weight.numel() == 0:
        return False
    levels = torch.tensor(IQ4_LEVELS, dtype=torch.int8)
    return bool(torch.isin(weight[0], levels).all())


def six_bits(ops: ModuleType, name: str, *, dot: bool) -> bool:
    """Whether a ``name`` layer packs its q at 6 bits: a q6_k layer that never takes the dot
    path (its integer kernels read whole bytes), in a build whose kernels read six blocks: on
    AVX-512 a lane-wise shift and a ``vpermi2w`` per 32 weights, as cheap as the int8 layout's
    look-up; on AVX2 two shifts per 6-bit field into the int16 lanes ``vpmaddwd`` reads (the
    few-row kernel and the tiles, bit for bit the int8 layout's sums). Three quarters of the
    bytes: the one-row decode streams them."""
    return name == "q6_k" and not dot and bool(ops.groupwise_six_bits())


def _pack_q6_k(
    ops: ModuleType,
    weight: torch.Tensor,
    scale: torch.Tensor,
    d: torch.Tensor,
    *,
    six: bool,
    storage: Storage | None = None,
) -> PackedGroupwise:
    sc = factor_q6_k(scale, d)
    if sc is None:
        raise ValueError("weight_scale: a q6_k layer's scales are not d * sc (sc a signed byte)")
    n, k = weight.shape
    half = _exact_in_half(d)
    index = sc.view(torch.uint8).reshape(n, k // GROUP_SIZE, 2)  # per group: k 0..15, 16..31
    bits = 6 if six else 8
    into = _into(ops, storage, n, k, bits, half, False, True, False)
    packed = ops.pack_groupwise(
        weight, scale, None, bits, half, False, d[..., None], index, False, into
    )
    return PackedGroupwise(packed, n, k, bits, half, False, True)

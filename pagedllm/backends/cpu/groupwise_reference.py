"""The definitions the group-wise kernels are checked against, in PyTorch.

The dot path's rounding of x (:func:`quantize_activation_groups`), the split kernel's two
rows (:func:`split_activation_groups`) and the dot path's whole arithmetic in float64
(:func:`dot_linear_reference`), with the layer's rows and integers as the references read them.
The load-time check (``groupwise_linear._check_paths``) and the tests compare the C++ GEMM with
these; they live apart from the kernels' installer so that the definitions read on their own.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.backends.cpu.groupwise_pack import scale_format
from pagedllm.layers.quantization.groupwise import GROUP_SIZE, dequantize_groups, weight_groups

_INT8_MAX = 127


def quantize_activation_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The dot path's rounding of ``x [M, K]``: (int8 ``[M, K]``, float32 ``dx [M, K/32]``).

    Per row and group of 32: ``dx = max|x| / 127`` (1 for an all-zero group) and
    ``xq = round(x / dx)`` (half to even), clamped to [-127, 127]; the C++ quantiser computes it
    bit for bit.
    """
    m, k = x.shape
    xf = x.float().reshape(m, k // GROUP_SIZE, GROUP_SIZE)  # [M, G, 32]
    dx = xf.abs().amax(dim=-1) / _INT8_MAX  # [M, G]
    dx = torch.where(dx > 0, dx, torch.ones_like(dx))
    xq = torch.round(xf / dx[..., None]).clamp_(-_INT8_MAX, _INT8_MAX)
    return xq.to(torch.int8).reshape(m, k), dx


def split_activation_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The split kernel's rounding of ``x [M, K]``: (int8 ``[2M, K]``, float32 ``dx [2M, K/32]``).

    Row ``2i`` is :func:`quantize_activation_groups` of row ``i``; row ``2i + 1`` the same
    rounding of what it left, ``x - dx * xq`` rounded once to float32 (an FMA). So
    ``x = dx xq + dx' xq' + e`` with ``|e| <= max|x| / 64,516`` per group: what few bf16 rows
    on a 4-bit layer run as by default (``groupwise_gemm``'s ``rows_kernel="split"``), the dot
    kernel on both rows, their sums added. The C++ quantiser computes it bit for bit.
    """
    m, k = x.shape
    xq, dx = quantize_activation_groups(x)
    xf = x.float().reshape(m, k // GROUP_SIZE, GROUP_SIZE).double()
    kept = xq.double().reshape(m, k // GROUP_SIZE, GROUP_SIZE) * dx.double()[..., None]
    rest = (xf - kept).float().reshape(m, k)  # exact in float64, then one rounding
    rq, rdx = quantize_activation_groups(rest)
    return (
        torch.stack((xq, rq), dim=1).reshape(2 * m, k),
        torch.stack((dx, rdx), dim=1).reshape(2 * m, k // GROUP_SIZE),
    )


def dot_linear_reference(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The dot path's arithmetic in float64 (only the order of its float32 group sums differs).

    ``q``: the weights' integers ``[N, K]`` (0..15 with ``offset``, else -127..127); ``scale``,
    ``offset`` float32 ``[N, K/32]``. Per group g of row m and column n, with exact integer sums
    ``isum = sum_k q xq`` and ``qsum = sum_k xq``:
    ``isum * fl32(scale * dx) + offset * fl32(dx * qsum)``; where every offset is
    ``-8 * scale`` (Q4_0, stored without offsets) ``(isum - 8 qsum) * fl32(scale * dx)``.
    q6_k (``scale [N, K/16]``): ``isum`` per 16 k times ``fl32(scale * dx)`` of its group's dx.
    """
    m, k = x.shape
    g = k // GROUP_SIZE
    size = k // scale.shape[1]  # k per scale: 32, or 16 (q6_k)
    xq, dx = quantize_activation_groups(x)
    xg = xq.double().reshape(m, k // size, size)  # [M, G', size]
    qg = q.double().reshape(-1, k // size, size)  # [N, G', size]
    isum = torch.einsum("mgk,ngk->mng", xg, qg)  # [M, N, G'], exact
    qsum = xq.double().reshape(m, g, GROUP_SIZE).sum(-1)  # [M, G], exact
    dxs = dx.repeat_interleave(GROUP_SIZE // size, dim=-1)  # [M, G']
    sd = (scale[None] * dxs[:, None]).double()  # [M, N, G']: the float32 product
    _, with_offset = scale_format(scale, offset)
    if offset is not None and not with_offset:
        isum = isum - 8 * qsum[:, None]
    y = (isum * sd).sum(-1)  # [M, N]
    if with_offset:
        xsum = (dx * qsum.float()).double()  # [M, G]: the float32 product
        y = y + xsum @ offset.double().T
    return y if bias is None else y + bias.double()


def dequantize_rows(layer: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """float32 ``[len(rows), K]``: the sampled output rows of ``dequantize_layer(layer)``."""
    scale, offset = weight_groups(layer)
    off = None if offset is None else offset[rows]
    return dequantize_groups(layer.weight[rows], scale[rows], off)


def weight_integers(layer: nn.Module) -> torch.Tensor:
    """The layer's q ``[N, K]`` (uint8 0..15 for 4-bit, int8 for 8-bit), for references."""
    from pagedllm.layers.quantization.groupwise import unpack_nibbles

    w = layer.weight
    return unpack_nibbles(w) if w.dtype == torch.uint8 else w

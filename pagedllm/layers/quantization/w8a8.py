"""W8A8: int8 weights per output channel and int8 activations per token, made at run time.

The weights are those of weight-only int8 (:mod:`.int8`); in addition each row (token) of a
layer's input is rounded to int8 with its own scale ``max|x[t, :]| / 127`` just before the
matmul, so that the product is a sum of int8 x int8 products: integer dot-product instructions
(AVX2 ``vpmaddubsw``, AVX-512 VNNI ``vpdpbusd``) then do several times the multiply-adds of float
FMAs. The rounding of the activations changes the numerics, which is why it is its own scheme
(``quantization="w8a8"``, vLLM's and compressed-tensors' name for int8 weights with dynamic
per-token int8 activations) rather than a faster "int8".

``y[t, n] = (sum_k qx[t, k] * qw[n, k]) * sx[t] * sw[n] (+ bias[n])``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.quantization.int8 import Int8WeightOnly, weight_scale

_QMAX = 127


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` -> (int8 ``[..., K]``, float32 scales ``[...]``), symmetric per row.

    The definition the CPU kernel reproduces bit for bit: ``s = max|x| / 127`` in float32 (1 for
    an all-zero row), ``q = round_half_even(x / s)`` clamped to [-127, 127].
    """
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / _QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf / scale.unsqueeze(-1)).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return q, scale


def w8a8_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The scheme in plain PyTorch: float64 sums of the int8 products (exact), in x's dtype."""
    q, sx = quantize_per_token(x)
    acc = F.linear(q.double(), qweight.double())  # [..., N], exact integers
    y = acc * sx.double().unsqueeze(-1) * w_scale.double()
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


class Int8W8A8(Int8WeightOnly):
    """Int8 weights (made at load or read from a W8A8 checkpoint), int8 activations per token."""

    name = "w8a8"
    weight_format = "w8a8"  # int8's tensors, multiplied by int8 activations made per token

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """PyTorch path (backends without the integer kernel): float32 sums of the products,
        exact while a sum stays below 2^24 in magnitude."""
        q, sx = quantize_per_token(x)
        acc = F.linear(q.float(), layer.weight.float())  # [..., N]
        y = acc * sx.unsqueeze(-1) * weight_scale(layer)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)

"""Normalisation layers, written to round exactly as Hugging Face's do: statistics in float32,
the result rounded to the activations' dtype (bfloat16/float16 too) where transformers rounds."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# (x, residual or None) -> (normed, x + residual): the shape of RMSNorm.forward.
NormFn = Callable[[torch.Tensor, "torch.Tensor | None"], tuple[torch.Tensor, torch.Tensor]]


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add: returns (normed, new_residual).

    ``fast_norm`` is a backend's one-pass kernel, installed by its ``prepare_model``; it rounds
    as :meth:`forward_native` does and hands it any input it cannot take.
    """

    fast_norm: NormFn | None = None

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.offset = offset  # Gemma stores weight - 1

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + self.weight.float())).to(dtype)
        return self.weight * xf.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fast_norm is not None:
            return self.fast_norm(x, residual)
        return self.forward_native(x, residual)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The definition (PyTorch ops): what every backend kernel is tested against."""
        if residual is not None:
            x = x + residual
        return self._norm(x), x


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm with weights that load through the same path as the others."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, bias: bool = True) -> None:
        super().__init__(hidden_size, eps=eps, bias=bias)
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)

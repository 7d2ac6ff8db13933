"""Normalisation layers, written to round exactly as Hugging Face's do: statistics in float32,
the result rounded to the activations' dtype (bfloat16/float16 too) where transformers rounds."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add: returns (normed, new_residual)."""

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

"""Gated activations over a fused [gate | up] projection."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``fast_act`` is a backend's one-pass kernel (``prepare_model``), rounding as
    :meth:`forward_native` does and handing it any input it cannot take."""

    fast_act: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, 2d] -> [n, d]
        if self.fast_act is not None:
            return self.fast_act(x)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """The definition (PyTorch ops): what every backend kernel is tested against."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """``fast_act``: as SiluAndMul's (a backend may fill it for ``approximate="tanh"``)."""

    fast_act: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast_act is not None:
            return self.fast_act(x)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """The definition (PyTorch ops): what every backend kernel is tested against."""
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


def get_act_fn(name: str) -> nn.Module:
    """Plain (non-gated) activations by their Hugging Face names."""
    table: dict[str, nn.Module] = {
        "relu": nn.ReLU(),
        "gelu": nn.GELU(),
        "gelu_new": nn.GELU(approximate="tanh"),
        "gelu_pytorch_tanh": nn.GELU(approximate="tanh"),
        "gelu_fast": nn.GELU(approximate="tanh"),
        "silu": nn.SiLU(),
    }
    if name not in table:
        raise ValueError(f"hidden_act: unsupported activation {name!r}")
    return table[name]

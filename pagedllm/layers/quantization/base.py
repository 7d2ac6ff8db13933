"""The linear-method interface: how a linear layer stores its weight and multiplies by it.

A method object per scheme (vLLM's ``LinearMethod`` idea) keeps the layers declarative: the layer
asks its method to reshape its parameters before loading, to finish them once every shard is in,
and to compute ``x @ W^T``. A backend may replace ``apply`` with a faster kernel through
``prepare_model`` (the layer's ``fast_linear`` slot), reading the method's tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The format of a weight held in a floating dtype (float32, bf16, fp16): its dtype, not the
# method, tells a backend which kernel runs it.
FLOAT = "float"


class LinearMethod:
    """The unquantized method: the layer's weight is used as it is."""

    name = "unquantized"
    # What a loaded layer's weight is stored as: the key a backend chooses its kernel by (a
    # method's name is its configuration's; several methods may share one stored format).
    weight_format: str = FLOAT

    def layer_format(self, layer: nn.Module) -> str:
        """``layer``'s weight format now: ``weight_format`` once quantised, float before (a
        layer whose weight is still the checkpoint's floats runs as an unquantised one)."""
        return self.weight_format if self.is_quantized(layer) else FLOAT

    def create_weights(self, layer: nn.Module) -> None:
        """Adjust ``layer``'s parameters before loading (the unquantized layer needs nothing)."""

    def finish_loading(self, layer: nn.Module) -> None:
        """Called once every shard of ``layer``'s weight has been loaded."""

    def is_quantized(self, layer: nn.Module) -> bool:
        return False

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


UNQUANTIZED = LinearMethod()

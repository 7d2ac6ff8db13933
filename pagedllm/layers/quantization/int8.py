"""Weight-only int8: per-output-channel symmetric int8 weights, activations in the model dtype.

``W[n, :] ~= q[n, :] * scale[n]`` with ``q`` in [-127, 127] and ``scale[n] = max|W[n, :]| / 127``.
Made at load from a 16/32-bit checkpoint (each layer right after its last shard is loaded, so the
full-precision copy of the whole model never exists at once; fused qkv / gate_up layers quantise
the fused weight) or read from a checkpoint already quantised that way (compressed-tensors W8A16).

The scale is kept as float32 in an ``int32`` buffer holding its bits: the loader casts every
floating tensor of the model to the compute dtype afterwards, and a bf16 scale would add a 0.4%
error per channel on top of the quantisation's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedllm.layers.quantization.base import LinearMethod

_QMAX = 127
_ROWS_PER_CHUNK = 1024  # quantise this many rows at a time: no float32 copy of a whole weight

# (weight [N, K], row maxima [N] or None) -> (int8 [N, K], float32 scales [N]), exactly as
# quantize_per_channel computes them. A device may supply a faster one (its ``int8_quantize``
# kernel, ``backends/kernels.py``): the definition below makes ~8 passes over each float
# chunk, which was most of an int8 1B model's load.
WeightQuantizer = Callable[[torch.Tensor, "torch.Tensor | None"], tuple[torch.Tensor, torch.Tensor]]


def row_absmax(weight: torch.Tensor) -> torch.Tensor:
    """``max|W[n, :]|`` as float32 ``[N]``.

    Taken in the weight's own dtype from its row minima and maxima (exact in any floating
    type), then widened: no copy of the weight at all.
    """
    if weight.shape[1] == 0:
        return torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
    low, high = torch.aminmax(weight, dim=1)
    return torch.maximum(high, -low).float()


def quantize_per_channel(
    weight: torch.Tensor, absmax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight[N, K]`` (any float dtype) -> (int8 ``[N, K]``, float32 scales ``[N]``).

    ``absmax`` overrides each row's own maximum: a row-parallel rank holds only part of every
    row, and must scale it as the whole row is scaled, or two ranks would not quantise the model
    one process quantises.
    """
    if absmax is None:
        absmax = row_absmax(weight)
    scale = absmax / _QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero rows: any scale
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    for start in range(0, weight.shape[0], _ROWS_PER_CHUNK):
        rows = weight[start : start + _ROWS_PER_CHUNK]  # [r, K]
        s = scale[start : start + _ROWS_PER_CHUNK]
        q[start : start + _ROWS_PER_CHUNK] = (
            torch.div(rows.float(), s[:, None]).round_().clamp_(-_QMAX, _QMAX)
        )
    return q, scale


# The low plane's step: the high plane's remainder is at most half a step, 127 low steps.
SPLIT_LO_STEPS = 254


def split_per_token(
    x: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (hi, lo int8 ``[M, K]``, s_hi, s_lo float32 ``[M]``) with
    ``x ~= hi * s_hi + lo * s_lo`` per row, to within ``max|x| / 64516``.

    How the CPU backend runs int8 weight-only layers on integer tile units (AMX-INT8): both
    planes go through exact int8 x int8 sums, so activations keep near-16-bit precision while
    the weights are never converted. The definition the C++ kernel reproduces, rounding for
    rounding: ``s_hi = max|x| / 127`` (1 for an all-zero row), ``hi = round(x * (1 / s_hi))``,
    ``s_lo = s_hi / 254``, ``lo = round((x - hi * s_hi) * (1 / s_lo))``, both clamped to +-127.
    """
    xf = x.float()
    s_hi = xf.abs().amax(dim=-1) / _QMAX
    s_hi = torch.where(s_hi > 0, s_hi, torch.ones_like(s_hi))
    s_lo = s_hi / SPLIT_LO_STEPS
    hi = torch.round(xf * (1 / s_hi)[:, None]).clamp_(-_QMAX, _QMAX)
    rest = xf - hi * s_hi[:, None]
    lo = torch.round(rest * (1 / s_lo)[:, None]).clamp_(-_QMAX, _QMAX)
    return hi.to(torch.int8), lo.to(torch.int8), s_hi, s_lo


def _whole_row_absmax(layer: nn.Module) -> torch.Tensor | None:
    """Every rank's row maxima joined (max over ranks) for a row-parallel layer, else None."""
    from pagedllm.layers.linear import RowParallelLinear

    tp = getattr(layer, "tp", None)
    if not isinstance(layer, RowParallelLinear) or tp is None or tp.size == 1:
        return None
    return tp.all_reduce_max(row_absmax(layer.weight.detach()))


def weight_scale(layer: nn.Module) -> torch.Tensor:
    """The float32 per-output-channel scales ``[N]`` of a quantised layer."""
    return layer.weight_scale_bits.view(torch.float32)


def dequantize(layer: nn.Module, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The layer's weight back in ``dtype`` (tests, reference checks)."""
    return (layer.weight.float() * weight_scale(layer)[:, None]).to(dtype)


class Int8WeightOnly(LinearMethod):
    """Int8 weights, scales applied to the outputs; ``prequantized`` reads int8 checkpoints.

    ``quantizer`` computes :func:`quantize_per_channel` (the device backend's own kernel, say).
    """

    name = "int8"
    weight_format = "int8"  # int8 [N, K] and a float32 scale per output row

    def __init__(
        self, *, prequantized: bool = False, quantizer: WeightQuantizer | None = None
    ) -> None:
        self.prequantized = prequantized
        self.quantize: WeightQuantizer = quantizer or quantize_per_channel

    def create_weights(self, layer: nn.Module) -> None:
        if not self.prequantized:
            return  # the float weight is loaded as usual, then quantised in finish_loading
        loader = layer.weight.weight_loader
        out_features = layer.weight.shape[0]
        from pagedllm.layers.linear import with_loader

        weight = torch.empty(layer.weight.shape, dtype=torch.int8)
        layer.weight = with_loader(nn.Parameter(weight, requires_grad=False), loader)
        # Per-output scales: sliced with the output rows (column-parallel), whole otherwise.
        scale = nn.Parameter(torch.empty(out_features, 1), requires_grad=False)
        layer.weight_scale = with_loader(scale, _scale_loader(layer))

    def finish_loading(self, layer: nn.Module) -> None:
        if self.is_quantized(layer):
            return
        if self.prequantized:
            scale = layer.weight_scale.detach().float().reshape(-1).contiguous()
            del layer.weight_scale
        else:
            q, scale = self.quantize(layer.weight.detach(), _whole_row_absmax(layer))
            layer.weight = nn.Parameter(q, requires_grad=False)
        layer.register_buffer("weight_scale_bits", scale.view(torch.int32))

    def is_quantized(self, layer: nn.Module) -> bool:
        return hasattr(layer, "weight_scale_bits")

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """PyTorch path (other backends): int8 values are exact in bf16/fp16, scale afterwards."""
        y = torch.nn.functional.linear(x, layer.weight.to(x.dtype))
        y = y * weight_scale(layer).to(x.dtype)
        return y if bias is None else y + bias


def _scale_loader(layer: nn.Module) -> object:
    """Column-parallel layers slice scales like their rows; row-parallel ones keep them whole."""
    from pagedllm.layers.linear import ColumnParallelLinear, default_weight_loader

    if isinstance(layer, ColumnParallelLinear):
        return layer.load_shard
    return default_weight_loader

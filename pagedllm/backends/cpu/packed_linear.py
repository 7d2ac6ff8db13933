"""Linear layers on oneDNN-packed weights: the CPU backend's faster GEMM for small batches.

PyTorch's default CPU GEMM streams a row-major weight poorly when few rows of activations meet a
large weight (decode steps; above all the LM head): repacking the weight once into oneDNN's
blocked layout measured 2-4x faster there. Each layer is checked against ``F.linear`` when it is
packed; any layer whose result differs, or a torch build without the ops, keeps ``F.linear``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

_BATCH_HINT = 64  # the batch oneDNN blocks for; any batch size works


def _ops_available() -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return bool(
        torch.backends.mkldnn.is_available()
        and mkldnn is not None
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
    )


def make_packed_linear(
    weight: torch.Tensor, bias: torch.Tensor | None
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``x -> x @ weight^T + bias`` on a packed copy of ``weight``; None if it cannot be used."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)
        probe = torch.randn(3, weight.shape[1])

        def linear(x: torch.Tensor) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

        expected = F.linear(probe, weight, bias)
        # Only the summation order may differ: allow float32 rounding at the output's scale.
        scale = float(expected.abs().max()) + 1.0
        torch.testing.assert_close(linear(probe), expected, rtol=1e-5, atol=1e-5 * scale)
    except (RuntimeError, AssertionError) as exc:
        logger.debug("keeping F.linear for a %s weight: %s", tuple(weight.shape), exc)
        return None
    return linear


def pack_linear_layers(model: nn.Module) -> int:
    """Install packed GEMMs on every layer that offers the ``fast_linear`` slot."""
    if not _ops_available():
        return 0
    from pagedllm.layers.linear import ColumnParallelLinear, RowParallelLinear

    head = getattr(model, "lm_head", None)
    count = 0
    with torch.inference_mode():
        for module in model.modules():
            is_linear = isinstance(module, (ColumnParallelLinear, RowParallelLinear))
            if not (is_linear or module is head):
                continue
            bias = getattr(module, "bias", None) if module.fast_linear_has_bias else None
            fn = make_packed_linear(module.weight, bias)
            if fn is not None:
                module.fast_linear = fn
                count += 1
                if is_linear:
                    # The packed copy is the only one used from now on: do not keep two. (A head
                    # may be the tied embedding, which still needs its rows: it keeps both.)
                    module.weight.data = torch.empty(0)
    logger.info("packed %d linear layers for oneDNN", count)
    return count

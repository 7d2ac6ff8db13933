"""The CPU's fused-MoE path: every expert's two GEMMs on packed weights.

Each local expert's ``w13 [2I, H]`` and ``w2 [H, I]`` get the GEMM a dense layer of the same
dtype gets (:mod:`.packed_linear`: oneDNN-packed float32, ``make_16bit_linear`` for bf16/fp16,
``make_int8_linear`` for int8 experts). A step's tokens are grouped by expert with one sort;
the loop runs over experts (not tokens), one GEMM per projection over all of an expert's
tokens. The stacked weights are dropped afterwards: the packed copies are the only ones used.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from pagedllm.backends.cpu import packed_linear as pl

logger = logging.getLogger(__name__)


def pack_weight(weight: torch.Tensor, scale: torch.Tensor | None) -> tuple[pl.LinearFn | None, str]:
    """The fastest correct GEMM for one ``[N, K]`` expert weight, and its path's name."""
    if scale is not None:
        return pl.make_int8_linear(weight, scale, None)
    return pl.make_dense_linear(weight, None)


def pack_moe_layer(layer: nn.Module) -> str:
    """Install packed per-expert GEMMs on one ``FusedMoE``; returns the path's name."""
    from pagedllm.layers.fused_moe import fused_experts_torch

    fns = []
    paths: set[str] = set()
    for e in range(layer.num_local_experts):
        pair = []
        for name in ("w13_weight", "w2_weight"):
            scale = layer.scales(name)
            fn, path = pack_weight(getattr(layer, name)[e], None if scale is None else scale[e])
            paths.add(path)
            pair.append(fn)
        if None in pair:
            return "torch"  # one expert without a packed GEMM: keep the layer's own path
        fns.append(tuple(pair))
    layer.fast_moe = functools.partial(fused_experts_torch, layer, expert_fns=fns)
    for name in ("w13_weight", "w2_weight"):
        getattr(layer, name).data = torch.empty(0, dtype=getattr(layer, name).dtype)
    layer.path = "+".join(sorted(paths))
    return layer.path


def pack_moe_layers(model: nn.Module) -> str:
    """Pack every MoE layer of ``model``; returns ``"FusedMoE=<paths>"`` or "" without any."""
    from pagedllm.layers.fused_moe import FusedMoE

    paths: set[str] = set()
    with torch.inference_mode():
        for module in model.modules():
            if isinstance(module, FusedMoE):
                paths.add(pack_moe_layer(module))
    if not paths:
        return ""
    summary = "FusedMoE=" + "+".join(sorted(paths))
    logger.info("expert layers: %s", summary)
    return summary

"""The CPU's fused-MoE path: every expert's two GEMMs on packed weights.

Each local expert's ``w13 [2I, H]`` and ``w2 [H, I]`` get the GEMM a dense layer of the same
dtype gets (:mod:`.packed_linear`: oneDNN-packed float32, ``make_16bit_linear`` for bf16/fp16,
``make_int8_linear`` for int8 experts, the group-wise GEMM for a GGUF file's quantised
experts, one expert's slice at a time). A step's tokens are grouped by expert with one sort;
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


class _GroupwiseExpert(nn.Module):
    """One expert's slice of a group-wise stack, shaped as the dense group-wise layers are
    (``weight``, ``weight_scale_bits``...), so that it gets their C++ GEMM and its checks."""

    def __init__(self, layer: nn.Module, name: str, e: int) -> None:
        from pagedllm.layers.quantization.groupwise import GroupwiseMethod

        super().__init__()
        q, scale, offset, sup = layer.groupwise_expert(name, e)
        self.quant_method = GroupwiseMethod.for_format(layer.groupwise[name])
        self.weight = q
        self.weight_scale_bits = scale.view(torch.int32)
        if offset is not None:
            self.weight_offset_bits = offset.view(torch.int32)
        if sup is not None:
            self.weight_super_bits = sup.view(torch.int32)


def _expert_gemm(
    layer: nn.Module, name: str, e: int, checked: set[tuple], dot: bool
) -> tuple[pl.LinearFn | None, str]:
    if name in layer.groupwise:
        from pagedllm.backends.cpu.groupwise_linear import make_groupwise_linear

        expert = _GroupwiseExpert(layer, name, e)
        return make_groupwise_linear(expert, None, dot=dot, checked=checked)
    scale = layer.scales(name)
    return pack_weight(getattr(layer, name)[e], None if scale is None else scale[e])


def pack_moe_layer(
    layer: nn.Module, checked: set[tuple] | None = None, *, int8_activations: bool = False
) -> str:
    """Install packed per-expert GEMMs on one ``FusedMoE``; returns the path's name.

    ``checked``: group-wise shapes whose kernel paths this load has already proven (see
    ``make_groupwise_linear``): a file's experts share two or three shapes.
    ``int8_activations``: group-wise experts take the dot path as the dense layers do (an
    expert sees a few rows a step, where the float path's time goes to converting every weight).
    """
    from pagedllm.layers.fused_moe import fused_experts_torch

    checked = set() if checked is None else checked
    fns = []
    paths: set[str] = set()
    for e in range(layer.num_local_experts):
        pair = []
        for name in ("w13_weight", "w2_weight"):
            fn, path = _expert_gemm(layer, name, e, checked, int8_activations)
            paths.add(path)
            pair.append(fn)
        if None in pair:
            return "torch"  # one expert without a packed GEMM: keep the layer's own path
        fns.append(tuple(pair))
    layer.fast_moe = functools.partial(fused_experts_torch, layer, expert_fns=fns)
    for name in ("w13_weight", "w2_weight"):  # the packed copies are the only ones used
        getattr(layer, name).data = torch.empty(0, dtype=getattr(layer, name).dtype)
        for suffix in ("_scale_bits", "_offset_bits", "_super_bits"):
            if name in layer.groupwise and hasattr(layer, name + suffix):
                setattr(layer, name + suffix, torch.empty(0, dtype=torch.int32))
    layer.paths = frozenset(paths)
    layer.path = "+".join(sorted(paths))
    return layer.path


def pack_moe_layers(model: nn.Module, *, int8_activations: bool = False) -> str:
    """Pack every MoE layer of ``model``; returns ``"FusedMoE=<paths>"`` or "" without any."""
    from pagedllm.layers.fused_moe import FusedMoE

    paths: set[str] = set()
    checked: set[tuple] = set()
    with torch.inference_mode():
        for module in model.modules():
            if isinstance(module, FusedMoE):
                path = pack_moe_layer(module, checked, int8_activations=int8_activations)
                paths.update(getattr(module, "paths", None) or {path})
    if not paths:
        return ""
    summary = "FusedMoE=" + "+".join(sorted(paths))
    logger.info("expert layers: %s", summary)
    return summary

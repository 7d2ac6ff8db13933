"""The CPU's fused-MoE path: every expert's two GEMMs on packed weights.

Each local expert's ``w13 [2I, H]`` and ``w2 [H, I]`` get the GEMM a dense layer of the same
dtype gets (:mod:`.dense_gemm`: oneDNN-packed float32, ``make_16bit_linear`` for bf16/fp16,
``make_int8_linear`` for int8 experts, the group-wise GEMM for a GGUF file's quantised
experts, one expert's slice at a time). A step's tokens are grouped by expert with one sort;
the loop runs over experts (not tokens), one GEMM per projection over all of an expert's
tokens. The stacked weights are dropped afterwards: the packed copies are the only ones used.

Group-wise experts (a GGUF file's stacks) run each projection of every expert that has tokens
as one C++ call (``groupwise_gemm_grouped``): at decode an expert sees a row or two, and one
call per expert paid Python's call, a thread fork and join and a drained read stream each time.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch import nn

from pagedllm.backends.cpu import dense_gemm as dg
from pagedllm.backends.cpu.groupwise_linear import EVERY_BATCH
from pagedllm.backends.cpu.linear_kernel import LinearFn, LinearKernel
from pagedllm.backends.cpu.packed_linear import groupwise_formats

logger = logging.getLogger(__name__)


def expert_formats() -> frozenset[str]:
    """The weight formats whose expert stacks run packed here: float (by dtype), int8 and the
    group-wise formats the dense layers run (one GEMM per expert slice)."""
    from pagedllm.layers.quantization.base import FLOAT
    from pagedllm.layers.quantization.int8 import Int8WeightOnly

    return frozenset({FLOAT, Int8WeightOnly.weight_format}) | groupwise_formats()


def pack_weight(weight: torch.Tensor, scale: torch.Tensor | None) -> LinearKernel:
    """The fastest correct GEMM for one ``[N, K]`` expert weight."""
    if scale is not None:
        return dg.make_int8_linear(weight, scale, None)
    return dg.make_dense_linear(weight, None)


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


class StackStorage:
    """Where a stack's group-wise experts are packed: one buffer (2 MiB-aligned, advised for
    huge pages), a slice per expert in expert order.

    Experts each in an allocation of its own (1.8 MB for a Qwen3-30B-A3B gate/up), made between
    other temporaries, read 1.4x slower from memory than the same panels side by side (8 such
    gate/ups at one row: 1.04 -> 0.72 ms on a Xeon VM); the engine's own load happened to
    allocate them in sequence (~1% there), which nothing guaranteed. An expert whose panels
    come out another size (another exact scale format) gets its own tensor; slices never handed
    out are never touched, so cost no memory.
    """

    def __init__(self, experts: int) -> None:
        self.experts = experts
        self.buffer: torch.Tensor | None = None
        self.taken = 0

    def __call__(self, shape: tuple[int, int]) -> torch.Tensor | None:
        if self.buffer is None:
            ops = dg.gemm_ops()
            if ops is None:  # the panels are packed by the same build: never here
                return None
            nbytes = self.experts * shape[0] * shape[1]
            self.buffer = ops.huge_page_empty(nbytes).view(self.experts, *shape)
        if tuple(self.buffer.shape[1:]) != tuple(shape) or self.taken == self.experts:
            return None
        self.taken += 1
        return self.buffer[self.taken - 1]


def _expert_gemm(
    layer: nn.Module,
    name: str,
    e: int,
    checked: set[tuple],
    dot: bool,
    storage: StackStorage | None = None,
) -> LinearKernel:
    if name in layer.groupwise:
        from pagedllm.backends.cpu.groupwise_linear import make_groupwise_linear

        expert = _GroupwiseExpert(layer, name, e)
        return make_groupwise_linear(expert, None, dot=dot, checked=checked, storage=storage)
    scale = layer.scales(name)
    return pack_weight(getattr(layer, name)[e], None if scale is None else scale[e])


_STACKS = ("w13_weight", "w2_weight")
GroupedGemm = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]


def make_grouped_gemm(kernels: list[LinearKernel], checked: set[tuple]) -> GroupedGemm | None:
    """``grouped(x [P, K], experts, starts) -> [P, N]``: rows ``starts[i]..starts[i + 1]`` of x
    through expert ``experts[i]``'s packed layer, in one C++ call, or None where the experts'
    layers are not all group-wise layers of one format and shape.

    Each group's rows get the arithmetic the expert's own GEMM gives them (the same kernels per
    panel); checked once per format and shape in a load (``checked``) to equal the per-expert
    calls bit for bit, on row counts that take the register kernels and the per-call ones.
    """
    pws = [pw for kernel in kernels if (pw := kernel.groupwise) is not None]
    fns = [fn for kernel in kernels if (fn := kernel.fn) is not None]
    ops = dg.gemm_ops()
    if ops is None or not kernels or len(pws) != len(kernels) or len(fns) != len(kernels):
        return None
    layout = pws[0].layout
    if any(pw.layout != layout for pw in pws):
        return None
    dot_rows = kernels[0].dot_rows
    if any(rows not in (0, EVERY_BATCH) for rows in dot_rows.values()):
        return None  # a per-batch choice of path: each expert decides for its own rows
    kernel = ops.groupwise_gemm_grouped
    packed = [pw.packed for pw in pws]
    n, k, bits, half_scales, with_offset, factored, levels = layout

    def grouped(x: torch.Tensor, experts: list[int], starts: list[int]) -> torch.Tensor:
        dot = dot_rows.get(x.dtype, 0) == EVERY_BATCH
        chosen = [packed[e] for e in experts]
        return kernel(x, chosen, starts, n, bits, half_scales, with_offset, factored, dot, levels)

    key = ("grouped", *layout, tuple(sorted(dot_rows.items(), key=str)))
    if key not in checked:
        if not _same_as_each(grouped, fns, k):
            return None
        checked.add(key)
    return grouped


def _same_as_each(grouped: GroupedGemm, fns: list[LinearFn], k: int) -> bool:
    """Whether ``grouped`` equals each expert's own GEMM on its rows, bit for bit: groups of
    1, 2 and 9 rows (the register kernels; past them the per-call paths), float32 and bf16."""
    experts = sorted({0, len(fns) // 2, len(fns) - 1})
    sizes = [1, 2, 9][: len(experts)]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(starts[-1], k, generator=generator).to(dtype)
        got = grouped(x, experts, starts)
        for i, e in enumerate(experts):
            want = fns[e](x[starts[i] : starts[i + 1]])
            if not torch.equal(got[starts[i] : starts[i + 1]], want):
                logger.warning(
                    "grouped expert GEMM differs from expert %d's own on %s rows; the experts"
                    " keep one call each",
                    e,
                    dtype,
                )
                return False
    return True


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
    kernels: list[tuple[LinearKernel, LinearKernel]] = []
    fns: list[tuple[LinearFn, LinearFn]] = []
    paths: set[str] = set()
    stacks = {name: StackStorage(layer.num_local_experts) for name in _STACKS}
    for e in range(layer.num_local_experts):
        w13, w2 = (
            _expert_gemm(layer, name, e, checked, int8_activations, stacks[name])
            for name in _STACKS
        )
        paths.update((w13.path, w2.path))
        if w13.fn is None or w2.fn is None:
            return "torch"  # one expert without a packed GEMM: keep the layer's own path
        kernels.append((w13, w2))
        fns.append((w13.fn, w2.fn))
    grouped = (
        make_grouped_gemm([pair[0] for pair in kernels], checked),
        make_grouped_gemm([pair[1] for pair in kernels], checked),
    )
    layer.fast_moe = functools.partial(fused_experts_torch, layer, expert_fns=fns, grouped=grouped)
    layer.expert_kernels = tuple(kernels)  # what was chosen per expert (paths, panels)
    if grouped != (None, None):
        paths.add("grouped")
    for name in _STACKS:  # the packed copies are the only ones used
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

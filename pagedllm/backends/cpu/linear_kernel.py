"""What every CPU linear factory returns: the contract between the per-layer choice
(``packed_linear``) and the GEMMs it chooses from (``dense_gemm``, ``groupwise_linear``), and
what the fused-MoE path groups. Its own module so that the factories and the chooser both import
it without importing each other's side.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedllm.backends.cpu.groupwise_pack import PackedGroupwise

LinearFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LinearKernel:
    """What a linear factory chose for one layer (or one expert's weight).

    A factory that cannot run the layer (no extension, a check that failed, an unpackable
    layout) still returns one, with ``fn`` None and a ``torch-...`` path: the name is what the
    log and benchmarks report either way.
    """

    fn: LinearFn | None  # x [..., K] -> [..., N]; None: the layer keeps its own forward
    path: str  # e.g. "cpp-int4-avx2+split", "onednn-float32", "torch-int8"
    # float32 rows [R, K] of W read back from the packed copy (the definition's values): what
    # an embedding tied to this head reads instead of keeping its table a second time.
    packed_rows: LinearFn | None = None
    # A group-wise GEMM's panels: what a grouped call over many such layers needs
    # (fused_moe.make_grouped_gemm).
    groupwise: PackedGroupwise | None = None
    # Up to how many rows of each activation dtype take the group-wise dot path.
    dot_rows: Mapping[torch.dtype, int] = field(default_factory=lambda: MappingProxyType({}))
    # A fused layer whose parts keep their own formats (``mixed``): each part's kernel, in
    # output order (``fn`` concatenates their outputs); what the decode stack runs in turn.
    parts: tuple[LinearKernel, ...] = ()

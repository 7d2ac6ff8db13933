"""Mixture-of-experts layers: routing, the fused expert layer and the sparse MoE block."""

from __future__ import annotations

from pagedllm.layers.fused_moe.layer import (
    FusedMoE,
    MoEFn,
    ReplicatedLinear,
    SparseMoeBlock,
    fused_experts_torch,
)
from pagedllm.layers.fused_moe.routing import (
    ExpertGroups,
    RoutingConfig,
    group_by_expert,
    select_experts,
)

__all__ = [
    "ExpertGroups",
    "FusedMoE",
    "MoEFn",
    "ReplicatedLinear",
    "RoutingConfig",
    "SparseMoeBlock",
    "fused_experts_torch",
    "group_by_expert",
    "select_experts",
]

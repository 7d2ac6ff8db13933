"""Mixtral: Mistral's attention with a mixture of SiLU-gated experts in every layer.

Routing: softmax over ``num_local_experts`` in float32, top ``num_experts_per_tok``, always
renormalised; the weights stay float32 when they scale the expert outputs. Checkpoints name the
block ``block_sparse_moe`` and the expert projections ``w1`` (gate), ``w3`` (up), ``w2`` (down).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from pagedllm.models.moe_base import MoeForCausalLM


class MixtralForCausalLM(MoeForCausalLM):
    num_experts_field = "num_local_experts"
    moe_intermediate_field = "intermediate_size"
    always_renormalize = True
    round_weights = False
    weight_renames: ClassVar[Mapping[str, str]] = {".block_sparse_moe.": ".mlp."}

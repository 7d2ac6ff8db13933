"""Qwen2-MoE and Qwen3-MoE.

Qwen2-MoE: Qwen2 attention (q/k/v bias from ``qkv_bias``, no o_proj bias), routed experts plus a
shared expert whose output is scaled per token by ``sigmoid(shared_expert_gate(x))``. Qwen3-MoE:
Qwen3 attention (per-head q/k RMSNorm), routed experts only. Both: softmax in float32, top-k,
renormalised when ``norm_topk_prob``, weights rounded to the activations' dtype; dense layers
where ``mlp_only_layers`` or ``decoder_sparse_step`` say so.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedllm.layers.parallel import TPContext
from pagedllm.models.llama import LlamaAttention
from pagedllm.models.moe_base import MoeForCausalLM, dense_mlp
from pagedllm.models.qwen3 import Qwen3Attention


class Qwen2MoeAttention(LlamaAttention):
    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["qkv_bias"] = bool(getattr(config, "qkv_bias", True))
        super().__init__(config, *args, **kwargs)


class Qwen2MoeForCausalLM(MoeForCausalLM):
    attention_cls = Qwen2MoeAttention

    def __init__(self, config: Any, **kwargs: Any) -> None:
        shared = getattr(config, "shared_expert_intermediate_size", None)
        if not isinstance(shared, int) or shared <= 0:
            raise ValueError(
                f"shared_expert_intermediate_size: {shared!r} must be a positive integer"
            )
        super().__init__(config, **kwargs)

    def shared_expert(self, config: Any, tp: TPContext) -> nn.Module | None:
        return dense_mlp(config, config.shared_expert_intermediate_size, tp)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    attention_cls = Qwen3Attention

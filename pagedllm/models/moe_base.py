"""What the mixture-of-experts families share: config checks, the MoE feed-forward, expert
weight names, and int8 experts.

Each family is a Llama-shaped decoder whose feed-forward is a :class:`SparseMoeBlock` on its
sparse layers (all of them, or every ``decoder_sparse_step``-th one outside ``mlp_only_layers``);
only routing details, the shared expert and attention norms differ. A config field this code
does not implement fails at load with a ValueError naming the field, never a silent fallback.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.layers.fused_moe import FusedMoE, RoutingConfig, SparseMoeBlock
from pagedllm.layers.parallel import TPContext
from pagedllm.models.checkpoint import WeightMapper
from pagedllm.models.llama import LlamaForCausalLM, LlamaMLP

# Routing variants of other MoE families (DeepSeek, GLM, ...) that these families never set;
# field -> the only value(s) we compute.
_UNSUPPORTED_ROUTING: dict[str, tuple[Any, ...]] = {
    "scoring_func": (None, "softmax"),
    "topk_method": (None, "greedy"),
    "n_group": (None, 0, 1),
    "topk_group": (None, 0, 1),
    "routed_scaling_factor": (None, 1, 1.0),
    "moe_layer_freq": (None, 1),
    "first_k_dense_replace": (None, 0),
    "n_shared_experts": (None, 0),
}


def check_moe_config(
    config: Any, *, num_experts: int, intermediate_field: str = "moe_intermediate_size"
) -> None:
    """ValueError naming the first field we do not implement."""
    for field, allowed in _UNSUPPORTED_ROUTING.items():
        value = getattr(config, field, None)
        if value not in allowed:
            raise ValueError(
                f"{field}: {value!r} is not supported for {type(config).__name__} "
                f"(supported: {[a for a in allowed if a is not None]}; routing is softmax, then "
                "top-k, then optional renormalisation)"
            )
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act: {act!r} is not supported for experts (only 'silu')")
    top_k = getattr(config, "num_experts_per_tok", None)
    if not isinstance(top_k, int) or not 1 <= top_k <= max(num_experts, 1):
        raise ValueError(f"num_experts_per_tok: {top_k!r} must be an integer in [1, {num_experts}]")
    size = getattr(config, intermediate_field, None)
    if not isinstance(size, int) or size <= 0:
        raise ValueError(f"{intermediate_field}: {size!r} must be a positive integer")
    norm = getattr(config, "norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ValueError(f"norm_topk_prob: {norm!r} must be true or false")
    step = getattr(config, "decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"decoder_sparse_step: {step!r} must be an integer >= 1")


def is_sparse_layer(config: Any, layer_idx: int, num_experts: int) -> bool:
    """transformers' rule: experts unless listed in ``mlp_only_layers`` or off the sparse step."""
    if layer_idx in (getattr(config, "mlp_only_layers", None) or []):
        return False
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return num_experts > 0 and (layer_idx + 1) % step == 0


# An expert's weight, or (a GGUF file's group-wise experts) its packed q's factors.
_EXPERT = re.compile(
    r"\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)"
    r"\.weight(_scale|_offset|_super)?$"
)
_PART = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": None, "down_proj": None}


class ExpertWeightMapper(WeightMapper):
    """Per-expert checkpoint tensors -> ``(stack name, (expert, part))`` for the expert loader."""

    def map(self, name: str) -> tuple[str, Any] | None:
        m = _EXPERT.search(name)
        if m is None:
            return super().map(name)
        mapped = super().map(name[: m.start()] + ".x")
        if mapped is None:
            return None
        prefix = mapped[0][: -len(".x")]
        part = _PART[m.group(2)]
        stack = "w2_weight" if part is None else "w13_weight"
        return f"{prefix}.experts.{stack}{m.group(3) or ''}", (int(m.group(1)), part)


def quantize_experts_like_dense(model: nn.Module) -> int:
    """int8 experts when the dense layers were quantised at load (``quantization="int8"``)."""
    from pagedllm.layers.linear import ColumnParallelLinear

    method = next(
        (
            m.quant_method
            for m in model.modules()
            if isinstance(m, ColumnParallelLinear) and m.quant_method is not None
        ),
        None,
    )
    if method is None or method.name != "int8":
        return 0
    if getattr(method, "prequantized", False):
        raise ValueError(
            "quantization: int8 checkpoints of mixture-of-experts models are not supported "
            "(quantize a float checkpoint at load with quantization='int8')"
        )
    # A GGUF file's group-wise experts stay as they are (its other layers may be int8).
    layers = [m for m in model.modules() if isinstance(m, FusedMoE) and not m.groupwise]
    with torch.no_grad():
        for layer in layers:
            layer.quantize_int8(method.quantize)
    return len(layers)


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-shaped decoder with :class:`SparseMoeBlock` feed-forwards on its sparse layers.

    Subclasses say where the config keeps the expert count and sizes, and whether the family
    rounds routing weights to the activations' dtype (see :mod:`..layers.fused_moe.routing`).
    """

    num_experts_field = "num_experts"
    moe_intermediate_field = "moe_intermediate_size"
    always_renormalize = False
    round_weights = True
    mapper_cls = ExpertWeightMapper

    def __init__(self, config: Any, **kwargs: Any) -> None:
        check_moe_config(
            config,
            num_experts=self.num_experts(config),
            intermediate_field=self.moe_intermediate_field,
        )
        super().__init__(config, **kwargs)

    def num_experts(self, config: Any) -> int:
        return int(getattr(config, self.num_experts_field))

    def routing(self, config: Any) -> RoutingConfig:
        return RoutingConfig(
            num_experts=self.num_experts(config),
            top_k=config.num_experts_per_tok,
            renormalize=self.always_renormalize or bool(getattr(config, "norm_topk_prob", False)),
            round_weights=self.round_weights,
        )

    def shared_expert(self, config: Any, tp: TPContext) -> nn.Module | None:
        return None

    def make_mlp(self, config: Any, layer_idx: int, tp: TPContext) -> nn.Module:
        if not is_sparse_layer(config, layer_idx, self.num_experts(config)):
            return super().make_mlp(config, layer_idx, tp)
        return SparseMoeBlock(
            hidden_size=config.hidden_size,
            intermediate_size=getattr(config, self.moe_intermediate_field),
            routing=self.routing(config),
            tp=tp,
            shared_expert=self.shared_expert(config, tp),
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        for layer in self.modules():
            if isinstance(layer, FusedMoE) and layer.groupwise:
                layer.finish_groupwise()
        quantize_experts_like_dense(self)
        return loaded


def dense_mlp(config: Any, intermediate: int, tp: TPContext) -> LlamaMLP:
    return LlamaMLP(config.hidden_size, intermediate, bias=False, tp=tp)

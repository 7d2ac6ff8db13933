"""Google's Gemma (first generation): a Llama with four twists, all taken from the config.

- embeddings are multiplied by ``sqrt(hidden_size)`` rounded to the model dtype (as
  transformers does: in bfloat16 ``sqrt(3072)`` becomes 55.5, not 55.4256);
- RMSNorm scales by ``1 + weight`` and rounds after the scale, not before;
- the MLP is GeGLU with the tanh approximation of GELU;
- ``head_dim`` is explicit (256 on gemma-7b, whose 16 heads are wider than hidden / heads).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.backends.base import AttentionBackend, AttentionMetadata
from pagedllm.layers.activation import GeluAndMul
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.parallel import SINGLE, TPContext
from pagedllm.models.llama import LlamaForCausalLM

# transformers' Gemma config maps its legacy "gelu" to the tanh approximation as well.
_TANH_GELUS = ("gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast")


def gemma_activation(config: Any) -> str:
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu")
    if act not in _TANH_GELUS:
        raise ValueError(f"hidden_activation: Gemma with {act!r} is not supported")
    return "tanh"


class GemmaForCausalLM(LlamaForCausalLM):
    def __init__(
        self,
        config: Any,
        *,
        attn_backend: AttentionBackend,
        tp: TPContext = SINGLE,
        max_position: int | None = None,
    ) -> None:
        super().__init__(config, attn_backend=attn_backend, tp=tp, max_position=max_position)
        eps = config.rms_norm_eps
        hidden = config.hidden_size
        approximate = gemma_activation(config)
        for layer in self.layers:
            layer.input_layernorm = RMSNorm(hidden, eps, offset=1.0)
            layer.post_attention_layernorm = RMSNorm(hidden, eps, offset=1.0)
            layer.mlp.act = GeluAndMul(approximate)
        self.norm = RMSNorm(hidden, eps, offset=1.0)
        # A buffer, so that moving the model to bfloat16 rounds it exactly as transformers does.
        self.register_buffer("normalizer", torch.tensor(hidden**0.5), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * self.normalizer.to(hidden.dtype)
        residual = None
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden

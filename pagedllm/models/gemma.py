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
from torch import nn

from pagedllm.backends.base import AttentionBackend
from pagedllm.layers.activation import GeluAndMul
from pagedllm.layers.parallel import SINGLE, WHOLE_MODEL, PPContext, TPContext
from pagedllm.models.llama import LlamaForCausalLM

# transformers' Gemma config maps its legacy "gelu" to the tanh approximation as well.
_TANH_GELUS = ("gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast")


def gemma_activation(config: Any) -> str:
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu")
    if act not in _TANH_GELUS:
        raise ValueError(f"hidden_activation: Gemma with {act!r} is not supported")
    return "tanh"


class GemmaForCausalLM(LlamaForCausalLM):
    norm_offset = 1.0

    def __init__(
        self,
        config: Any,
        *,
        attn_backend: AttentionBackend,
        tp: TPContext = SINGLE,
        pp: PPContext = WHOLE_MODEL,
        max_position: int | None = None,
    ) -> None:
        super().__init__(config, attn_backend=attn_backend, tp=tp, pp=pp, max_position=max_position)
        # A plain float, rounded to the activations' dtype at use by the same call transformers
        # makes (a buffer would be built on the meta device along with the parameters).
        self.normalizer = config.hidden_size**0.5

    def make_act(self, config: Any) -> nn.Module:
        return GeluAndMul(gemma_activation(config))

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None  # the first pipeline stage's
        hidden = self.embed_tokens(input_ids)
        return hidden * torch.tensor(self.normalizer, dtype=hidden.dtype, device=hidden.device)

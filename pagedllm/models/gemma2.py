"""Google's Gemma 2: Gemma (embedding scale, ``1 + weight`` RMSNorm, tanh GeGLU) plus four
changes, all read from the config:

- every sub-layer is normalised on both sides: ``post_attention_layernorm`` normalises the
  attention's output before the residual add, and ``pre_feedforward_layernorm`` /
  ``post_feedforward_layernorm`` wrap the MLP (``input_layernorm`` as in Llama);
- attention scores are soft-capped, ``cap * tanh(s / cap)`` with ``attn_logit_softcapping``
  (50 on the released models), by the attention backend before the softmax;
- queries are scaled by ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``;
- layers alternate local (``sliding_window``) and global attention (``layer_types``), and the
  final logits are soft-capped with ``final_logit_softcapping`` (30), in the logits' dtype as
  transformers does.

The per-layer windows leave the cache's blocks whole (the global layers read every token), so
the block manager frees nothing outside a window for this family.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pagedllm.backends.base import AttentionMetadata
from pagedllm.layers.norm import RMSNorm
from pagedllm.models.gemma import GemmaForCausalLM
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer


def _positive_or_none(config: Any, name: str) -> float | None:
    value = getattr(config, name, None)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < math.inf:
        raise ValueError(f"{name}: must be a positive number or null, got {value!r}")
    return float(value)


class Gemma2Attention(LlamaAttention):
    def attention_scale(self, config: Any) -> float:
        scalar = _positive_or_none(config, "query_pre_attn_scalar") or self.head_size
        return scalar**-0.5

    def logits_soft_cap(self, config: Any) -> float | None:
        return _positive_or_none(config, "attn_logit_softcapping")


class Gemma2DecoderLayer(LlamaDecoderLayer):
    """Llama's layer with a norm after the attention and two around the MLP; the residual
    stream is carried as Llama's is (the fused add in the norm that starts each half)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        eps, offset = config.rms_norm_eps, self.input_layernorm.offset
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset=offset)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset=offset)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, _ = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden, _ = self.post_feedforward_layernorm(self.mlp(hidden))
        return hidden, residual


class Gemma2ForCausalLM(GemmaForCausalLM):
    attention_cls = Gemma2Attention
    decoder_layer_cls = Gemma2DecoderLayer

    def __init__(self, config: Any, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.final_logit_softcapping = _positive_or_none(config, "final_logit_softcapping")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab]
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

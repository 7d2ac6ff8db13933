"""Qwen3 (dense): Llama's layers plus an RMSNorm over each head of q and k before the rotation.

There are no q/k/v biases (unlike Qwen2); ``head_dim`` is explicit (128 on every size) and
sliding windows are per layer (``layer_types``), both handled by the Llama code.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.backends.base import AttentionMetadata
from pagedllm.layers.norm import RMSNorm
from pagedllm.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    qk_norm_offset = 0.0  # Gemma 3's per-head norms scale by 1 + weight

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = args[0]
        offset = self.qk_norm_offset
        self.q_norm = RMSNorm(self.head_size, config.rms_norm_eps, offset=offset)
        self.k_norm = RMSNorm(self.head_size, config.rms_norm_eps, offset=offset)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, _ = self.q_norm(q.reshape(n, self.num_heads, self.head_size))
        k, _ = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_size))
        q, k = self.rotary(positions, q, k)
        out = self.attn(q.reshape(n, -1), k.reshape(n, -1), v, kv_cache, meta)
        return self.o_proj(out)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention

"""Bidirectional attention within each sequence of a flat batch, with no KV cache.

Encoders (BERT and its family) see every token of their input at once and keep nothing for a
later step, so they need neither the paged cache nor causality: each sequence of the step's flat
batch (``meta.query_lens_list``, back to back) attends to all of its own tokens and to no other
sequence's. ``fast_encoder_attn`` is the device's kernel (the ``encoder_attention`` op of
``backends/kernels.py``, installed by ``prepare_model``); :meth:`EncoderAttention.forward_native`
is its definition, what every kernel is tested against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedllm.backends.base import AttentionMetadata

# (q, k, v [num_tokens, num_heads, head_size], query_lens, scale) -> [num_tokens, heads, head]
EncoderAttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[int], float], torch.Tensor]


class EncoderAttention(nn.Module):
    fast_encoder_attn: EncoderAttnFn | None = None

    def __init__(self, *, num_heads: int, head_size: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads * head_size]
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_size]
        n = q.shape[0]
        shape = (n, self.num_heads, self.head_size)
        q, k, v = q.reshape(shape), k.reshape(shape), v.reshape(shape)
        lens = meta.query_lens_list
        if self.fast_encoder_attn is not None:
            out = self.fast_encoder_attn(q, k, v, lens, self.scale)
        else:
            out = self.forward_native(q, k, v, lens, self.scale)
        return out.reshape(n, self.num_heads * self.head_size)

    @staticmethod
    def forward_native(
        q: torch.Tensor,  # [num_tokens, num_heads, head_size]
        k: torch.Tensor,
        v: torch.Tensor,
        query_lens: list[int],
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size], q's dtype
        """Softmax attention per sequence, scores and weights in float32."""
        if sum(query_lens) != q.shape[0]:
            raise ValueError(f"encoder attention: query_lens {query_lens} != {q.shape[0]} tokens")
        out = torch.empty_like(q)
        start = 0
        for length in query_lens:
            end = start + length
            qs, ks, vs = (t[start:end].transpose(0, 1).float() for t in (q, k, v))
            weights = torch.softmax((qs @ ks.transpose(1, 2)) * scale, dim=-1)  # [heads, L, L]
            out[start:end] = (weights @ vs).transpose(0, 1).to(q.dtype)
            start = end
        return out

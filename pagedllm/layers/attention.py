"""The attention layer a model calls: store this step's K/V, then paged attention.

It holds no cache itself; the layer's KV tensor and the step's metadata arrive as arguments,
so the same module works for every backend and every batch.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedllm.backends.base import AttentionBackend, AttentionMetadata
from pagedllm.backends.kv_layout import FP8_DTYPES


class Attention(nn.Module):
    def __init__(
        self,
        backend: AttentionBackend,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.sliding_window = sliding_window
        if logits_soft_cap is not None and not 0 < logits_soft_cap < math.inf:
            raise ValueError(f"logits_soft_cap must be > 0 and finite, got {logits_soft_cap}")
        # Gemma 2's tanh cap on the scores; passed to the backend only when set.
        self.extra = {} if logits_soft_cap is None else {"logits_soft_cap": float(logits_soft_cap)}
        # An fp8 cache holds k / k_scale and v / v_scale. Checkpoints calibrated for it carry
        # the scales (read by models/checkpoint_kv_scales.py); the others keep 1.0.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads * head_size] or [num_tokens, num_heads, head]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_size] or per head, as q
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_size]
        n = q.shape[0]
        # Per-head views are what the backends take; a caller that has them passes them as they
        # are (a view call per tensor per layer is not free at decode sizes).
        if q.dim() == 2:
            q = q.view(n, self.num_heads, self.head_size)
        if k.dim() == 2:
            k = k.view(n, self.num_kv_heads, self.head_size)
        if v.dim() == 2:
            v = v.view(n, self.num_kv_heads, self.head_size)
        # Only backends that accept fp8 caches take the scales (16-bit caches have none).
        scales = (
            {"k_scale": self.k_scale, "v_scale": self.v_scale}
            if kv_cache.dtype in FP8_DTYPES
            else {}
        )
        self.backend.write_kv(k, v, kv_cache, meta.slot_mapping, **scales)
        out = self.backend.forward(
            q,
            kv_cache,
            meta,
            self.scale,
            sliding_window=self.sliding_window,
            **scales,
            **self.extra,
        )
        return out.reshape(n, self.num_heads * self.head_size)

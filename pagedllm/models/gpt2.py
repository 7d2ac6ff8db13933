"""OpenAI's GPT-2: learned positions, pre-LayerNorm blocks, gelu_new MLP, tied LM head.

GPT-2 checkpoints store their projections as ``Conv1D`` with weights shaped ``[in, out]``: they
are transposed once at load so every layer is an ordinary ``[out, in]`` linear, and the fused
``c_attn`` (q | k | v, equal widths) is split so that each part is sharded like any QKV.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.backends.base import AttentionBackend, AttentionMetadata
from pagedllm.layers.activation import get_act_fn
from pagedllm.layers.attention import Attention
from pagedllm.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    lm_head_for,
)
from pagedllm.layers.norm import LayerNorm
from pagedllm.layers.parallel import SINGLE, TPContext
from pagedllm.models.checkpoint import WeightMapper, load_mapped_weights

_CONV1D = ("c_attn", "c_proj", "c_fc")  # modules stored as Conv1D: weight is [in, out]


class GPT2Attention(nn.Module):
    def __init__(
        self, config: Any, layer_idx: int, backend: AttentionBackend, *, tp: TPContext
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        heads = config.num_attention_heads
        head_size = hidden // heads
        self.c_attn = QKVParallelLinear(hidden, head_size, heads, heads, bias=True, tp=tp)
        self.c_proj = RowParallelLinear(hidden, hidden, bias=True, tp=tp)
        scale = head_size**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)
        self.attn = Attention(
            backend,
            num_heads=self.c_attn.num_heads,
            num_kv_heads=self.c_attn.num_kv_heads,
            head_size=head_size,
            scale=scale,
        )

    def forward(
        self, hidden: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [num_tokens, hidden]
        q, k, v = self.c_attn.split(self.c_attn(hidden))
        return self.c_proj(self.attn(q, k, v, kv_cache, meta))


class GPT2MLP(nn.Module):
    def __init__(self, config: Any, *, tp: TPContext) -> None:
        super().__init__()
        hidden = config.hidden_size
        inner = config.n_inner or 4 * hidden
        self.c_fc = ColumnParallelLinear(hidden, [inner], bias=True, tp=tp)
        self.c_proj = RowParallelLinear(inner, hidden, bias=True, tp=tp)
        self.act = get_act_fn(config.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(
        self, config: Any, layer_idx: int, backend: AttentionBackend, *, tp: TPContext
    ) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = LayerNorm(config.hidden_size, eps)
        self.attn = GPT2Attention(config, layer_idx, backend, tp=tp)
        self.ln_2 = LayerNorm(config.hidden_size, eps)
        self.mlp = GPT2MLP(config, tp=tp)

    def forward(
        self, hidden: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.attn(self.ln_1(hidden), kv_cache, meta) + hidden
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2LMHeadModel(nn.Module):
    def __init__(
        self,
        config: Any,
        *,
        attn_backend: AttentionBackend,
        tp: TPContext = SINGLE,
        max_position: int | None = None,  # unused: a learned table cannot grow
    ) -> None:
        super().__init__()
        if getattr(config, "add_cross_attention", False):
            raise ValueError("add_cross_attention: GPT-2 with cross-attention is not a decoder LM")
        self.config = config
        self.tp = tp
        hidden = config.hidden_size
        self.wte = VocabParallelEmbedding(config.vocab_size, hidden, tp=tp)
        self.wpe = VocabParallelEmbedding(config.max_position_embeddings, hidden, tp=SINGLE)
        self.h = nn.ModuleList(
            GPT2Block(config, i, attn_backend, tp=tp) for i in range(config.num_hidden_layers)
        )
        self.ln_f = LayerNorm(hidden, config.layer_norm_epsilon)
        self.lm_head = lm_head_for(config, self.wte, hidden, tied_default=True)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        hidden = self.wte(input_ids) + self.wpe(positions)
        for block, cache in zip(self.h, kv_caches, strict=True):
            hidden = block(hidden, cache, meta)
        return self.ln_f(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab]
        return self.lm_head.logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        mapper = WeightMapper(
            strip_prefixes=("transformer.",),
            fused={"c_attn_q": ("c_attn", 0), "c_attn_k": ("c_attn", 1), "c_attn_v": ("c_attn", 2)},
            # Old checkpoints carry the causal-mask buffers ("attn.bias", "attn.masked_bias").
            ignore=(".attn.bias", ".attn.masked_bias"),
        )
        tied = self.lm_head is self.wte
        return load_mapped_weights(self, conv1d_to_linear(weights), mapper, skip_lm_head=tied)


def conv1d_to_linear(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Transpose Conv1D weights to ``[out, in]`` and split ``c_attn`` into its q, k, v parts."""
    for name, tensor in weights:
        parts = name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        if module in _CONV1D and parts[-1] == "weight" and tensor.dim() == 2:
            tensor = tensor.t()
        if module == "c_attn" and parts[-1] in ("weight", "bias"):
            for suffix, piece in zip("qkv", tensor.chunk(3, dim=0), strict=True):
                parts[-2] = f"c_attn_{suffix}"
                yield ".".join(parts), piece
            continue
        yield name, tensor

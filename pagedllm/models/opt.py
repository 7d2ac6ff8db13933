"""Meta's OPT (facebook/opt-*): learned positions, LayerNorm, ReLU MLP, biased projections.

Differences between checkpoints come from the config: ``do_layer_norm_before`` (opt-350m puts
the LayerNorms after the residual adds and has no final LayerNorm), ``word_embed_proj_dim``
(opt-350m embeds in 512 and projects in/out of the 1024-wide decoder) and ``enable_bias``.
The learned position table has two extra leading rows: position ``p`` reads row ``p + 2``.
"""

from __future__ import annotations

from collections.abc import Iterable
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

POSITION_OFFSET = 2  # OPT's position table starts two rows in (a fairseq padding legacy)


def make_layer_norm(hidden: int, eps: float, affine: bool) -> nn.Module:
    """A LayerNorm whose parameters load like any other; ``affine=False`` has none at all."""
    if affine:
        return LayerNorm(hidden, eps)
    return nn.LayerNorm(hidden, eps=eps, elementwise_affine=False)


class OPTAttention(nn.Module):
    def __init__(self, config: Any, backend: AttentionBackend, *, tp: TPContext) -> None:
        super().__init__()
        hidden = config.hidden_size
        heads = config.num_attention_heads
        self.head_size = hidden // heads
        bias = bool(getattr(config, "enable_bias", True))
        self.qkv_proj = QKVParallelLinear(hidden, self.head_size, heads, heads, bias=bias, tp=tp)
        self.out_proj = RowParallelLinear(hidden, hidden, bias=bias, tp=tp)
        # OPT scales q before the product (not the scores); same order keeps the rounding.
        self.scaling = self.head_size**-0.5
        self.attn = Attention(
            backend,
            num_heads=self.qkv_proj.num_heads,
            num_kv_heads=self.qkv_proj.num_kv_heads,
            head_size=self.head_size,
            scale=1.0,
        )

    def forward(
        self, hidden: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [num_tokens, hidden]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        return self.out_proj(self.attn(q * self.scaling, k, v, kv_cache, meta))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: Any, backend: AttentionBackend, *, tp: TPContext) -> None:
        super().__init__()
        hidden = config.hidden_size
        bias = bool(getattr(config, "enable_bias", True))
        affine = bool(getattr(config, "layer_norm_elementwise_affine", True))
        self.pre_norm = bool(config.do_layer_norm_before)
        self.self_attn = OPTAttention(config, backend, tp=tp)
        self.self_attn_layer_norm = make_layer_norm(hidden, 1e-5, affine)
        self.fc1 = ColumnParallelLinear(hidden, [config.ffn_dim], bias=bias, tp=tp)
        self.fc2 = RowParallelLinear(config.ffn_dim, hidden, bias=bias, tp=tp)
        self.act = get_act_fn(config.activation_function)
        self.final_layer_norm = make_layer_norm(hidden, 1e-5, affine)

    def forward(
        self, hidden: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        residual = hidden
        if self.pre_norm:
            hidden = self.self_attn_layer_norm(hidden)
        hidden = residual + self.self_attn(hidden, kv_cache, meta)
        if not self.pre_norm:
            hidden = self.self_attn_layer_norm(hidden)
        residual = hidden
        if self.pre_norm:
            hidden = self.final_layer_norm(hidden)
        hidden = residual + self.fc2(self.act(self.fc1(hidden)))
        if not self.pre_norm:
            hidden = self.final_layer_norm(hidden)
        return hidden


class OPTForCausalLM(nn.Module):
    def __init__(
        self,
        config: Any,
        *,
        attn_backend: AttentionBackend,
        tp: TPContext = SINGLE,
        max_position: int | None = None,  # unused: a learned table cannot grow
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        hidden = config.hidden_size
        embed_dim = config.word_embed_proj_dim or hidden
        affine = bool(getattr(config, "layer_norm_elementwise_affine", True))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, embed_dim, tp=tp)
        # Position table, input and output projections are small: every rank keeps all of them.
        self.embed_positions = VocabParallelEmbedding(
            config.max_position_embeddings + POSITION_OFFSET, hidden, tp=SINGLE
        )
        self.project_in: nn.Module | None = None
        self.project_out: nn.Module | None = None
        if embed_dim != hidden:
            self.project_in = ColumnParallelLinear(embed_dim, [hidden], tp=SINGLE)
            self.project_out = ColumnParallelLinear(hidden, [embed_dim], tp=SINGLE)
        self.layers = nn.ModuleList(
            OPTDecoderLayer(config, attn_backend, tp=tp) for _ in range(config.num_hidden_layers)
        )
        self.final_layer_norm: nn.Module | None = None
        if config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False):
            self.final_layer_norm = make_layer_norm(hidden, 1e-5, affine)
        self.lm_head = lm_head_for(config, self.embed_tokens, embed_dim, tied_default=True)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, word_embed_proj_dim]
        hidden = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        hidden = hidden + self.embed_positions(positions + POSITION_OFFSET)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cache, meta)
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab]
        return self.lm_head.logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        mapper = WeightMapper(
            # Hub checkpoints name the decoder "decoder." or "model.decoder."; the head stays.
            strip_prefixes=("model.decoder.", "decoder."),
            fused={"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)},
        )
        tied = self.lm_head is self.embed_tokens
        return load_mapped_weights(self, weights, mapper, skip_lm_head=tied)

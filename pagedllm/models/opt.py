"""Meta's OPT (facebook/opt-*): learned positions, LayerNorm, ReLU MLP, biased projections.

Differences between checkpoints come from the config: ``do_layer_norm_before`` (opt-350m puts
the LayerNorms after the residual adds and has no final LayerNorm), ``word_embed_proj_dim``
(opt-350m embeds in 512 and projects in/out of the 1024-wide decoder) and ``enable_bias``.
The learned position table has two extra leading rows: position ``p`` reads row ``p + 2``.
"""

from __future__ import annotations

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
)
from pagedllm.layers.norm import LayerNorm
from pagedllm.layers.parallel import SINGLE, WHOLE_MODEL, PPContext, TPContext
from pagedllm.models.causal_lm import CausalLM

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
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: None,  # OPT adds the residual inside the layer
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, None]:
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
        return hidden, None


class OPTForCausalLM(CausalLM):
    tied_default = True
    carries_residual = False
    # Hub checkpoints name the decoder "decoder." or "model.decoder."; the head stays.
    checkpoint_prefixes = ("model.decoder.", "decoder.")

    def __init__(
        self,
        config: Any,
        *,
        attn_backend: AttentionBackend,
        tp: TPContext = SINGLE,
        pp: PPContext = WHOLE_MODEL,
        max_position: int | None = None,  # unused: a learned table cannot grow
    ) -> None:
        super().__init__(config, tp=tp, pp=pp)
        hidden = config.hidden_size
        embed_dim = config.word_embed_proj_dim or hidden
        affine = bool(getattr(config, "layer_norm_elementwise_affine", True))
        self.embed_tokens: VocabParallelEmbedding | None = None
        if self.holds_embedding:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, embed_dim, tp=tp)
        # Position table, input and output projections are small: every rank keeps all of them.
        self.embed_positions: VocabParallelEmbedding | None = None
        self.project_in: nn.Module | None = None
        self.project_out: nn.Module | None = None
        if pp.is_first:
            self.embed_positions = VocabParallelEmbedding(
                config.max_position_embeddings + POSITION_OFFSET, hidden, tp=SINGLE
            )
            if embed_dim != hidden:
                self.project_in = ColumnParallelLinear(embed_dim, [hidden], tp=SINGLE)
        self.layers = self.stage_layers(lambda i: OPTDecoderLayer(config, attn_backend, tp=tp))
        self.final_layer_norm: nn.Module | None = None
        self.lm_head: VocabParallelEmbedding | None = None
        if pp.is_last:
            if embed_dim != hidden:
                self.project_out = ColumnParallelLinear(hidden, [embed_dim], tp=SINGLE)
            final_norm = not getattr(config, "_remove_final_layer_norm", False)
            if config.do_layer_norm_before and final_norm:
                self.final_layer_norm = make_layer_norm(hidden, 1e-5, affine)
            self.lm_head = self.make_lm_head(self.embed_tokens, embed_dim)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None and self.embed_positions is not None
        hidden = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        return hidden + self.embed_positions(positions + POSITION_OFFSET)

    def finish(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden  # [num_tokens, word_embed_proj_dim]

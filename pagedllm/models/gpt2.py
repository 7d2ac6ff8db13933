"""OpenAI's GPT-2: learned positions, pre-LayerNorm blocks, gelu_new MLP, tied LM head.

GPT-2 checkpoints store their projections as ``Conv1D`` with weights shaped ``[in, out]``: they
are transposed once at load so every layer is an ordinary ``[out, in]`` linear, and the fused
``c_attn`` (q | k | v, equal widths) is split so that each part is sharded like any QKV.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
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

_CONV1D = ("c_attn", "c_proj", "c_fc")  # modules stored as Conv1D: weight is [in, out]
# conv1d_to_linear's parts of c_attn, fused again by the mapper (sharded part by part).
C_ATTN_FUSED: Mapping[str, tuple[str, int]] = {
    f"c_attn_{part}": ("c_attn", i) for i, part in enumerate("qkv")
}


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
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: None,  # GPT-2 adds the residual inside the block
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, None]:
        hidden = self.attn(self.ln_1(hidden), kv_cache, meta) + hidden
        return hidden + self.mlp(self.ln_2(hidden)), None


class GPT2LMHeadModel(CausalLM):
    layers_name = "h"
    embedding_name = "wte"
    tied_default = True
    carries_residual = False
    checkpoint_prefixes = ("transformer.",)
    fused_weights = C_ATTN_FUSED
    # Old checkpoints carry the causal-mask buffers ("attn.bias", "attn.masked_bias").
    ignored_weights = (".attn.bias", ".attn.masked_bias")

    def __init__(
        self,
        config: Any,
        *,
        attn_backend: AttentionBackend,
        tp: TPContext = SINGLE,
        pp: PPContext = WHOLE_MODEL,
        max_position: int | None = None,  # unused: a learned table cannot grow
    ) -> None:
        if getattr(config, "add_cross_attention", False):
            raise ValueError("add_cross_attention: GPT-2 with cross-attention is not a decoder LM")
        super().__init__(config, tp=tp, pp=pp)
        hidden = config.hidden_size
        self.wte: VocabParallelEmbedding | None = None
        self.wpe: VocabParallelEmbedding | None = None
        if self.holds_embedding:
            self.wte = VocabParallelEmbedding(config.vocab_size, hidden, tp=tp)
        if pp.is_first:
            self.wpe = VocabParallelEmbedding(config.max_position_embeddings, hidden, tp=SINGLE)
        self.h = self.stage_layers(lambda i: GPT2Block(config, i, attn_backend, tp=tp))
        self.ln_f: LayerNorm | None = None
        self.lm_head: VocabParallelEmbedding | None = None
        if pp.is_last:
            self.ln_f = LayerNorm(hidden, config.layer_norm_epsilon)
            self.lm_head = self.make_lm_head(self.wte, hidden)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        assert self.wte is not None and self.wpe is not None  # the first pipeline stage's
        return self.wte(input_ids) + self.wpe(positions)

    def finish(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        assert self.ln_f is not None
        return self.ln_f(hidden)

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        return conv1d_to_linear(weights)


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

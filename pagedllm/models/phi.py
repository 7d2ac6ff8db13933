"""Microsoft's Phi (phi-1, phi-1.5, phi-2) and Phi-3 / Phi-4-mini.

Phi runs attention and MLP in parallel off one LayerNorm (``h + attn(ln(h)) + mlp(ln(h))``),
rotates only ``partial_rotary_factor`` of each head, and has biases everywhere, the LM head
included. Phi-3 is a Llama with q/k/v and gate/up already fused in the checkpoint: the fused
tensors are split at load so they shard across tensor-parallel ranks like Llama's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.backends.base import AttentionBackend, AttentionMetadata
from pagedllm.layers.activation import get_act_fn
from pagedllm.layers.attention import Attention
from pagedllm.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    with_loader,
)
from pagedllm.layers.norm import LayerNorm
from pagedllm.layers.parallel import SINGLE, WHOLE_MODEL, PPContext, TPContext
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.causal_lm import CausalLM
from pagedllm.models.checkpoint import CheckpointError
from pagedllm.models.llama import LlamaForCausalLM, head_size_of, rope_partial_factor


class BiasedLMHead(ParallelLMHead):
    """An LM head with a bias, split over the vocabulary like its weight."""

    def __init__(self, vocab_size: int, hidden_size: int, *, tp: TPContext = SINGLE) -> None:
        super().__init__(vocab_size, hidden_size, tp=tp)
        self.bias = with_loader(
            nn.Parameter(torch.empty(self.shard), requires_grad=False), self.load_weight
        )

    fast_linear_has_bias = True

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab]
        if self.fast_linear is not None:
            local = self.fast_linear(hidden)  # [n, shard]
        else:
            local = F.linear(hidden, self.weight, self.bias)  # [n, shard]
        return self.tp.all_gather_last_dim(local)[:, : self.vocab_size]


class PhiAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        *,
        tp: TPContext,
    ) -> None:
        super().__init__()
        head = head_size_of(config)
        num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head, config.num_attention_heads, num_kv, bias=True, tp=tp
        )
        self.dense = RowParallelLinear(
            config.num_attention_heads * head, config.hidden_size, bias=True, tp=tp
        )
        self.rotary = rotary
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_size = head
        self.q_layernorm: nn.Module | None = None
        self.k_layernorm: nn.Module | None = None
        if getattr(config, "qk_layernorm", False):
            self.q_layernorm = LayerNorm(head, config.layer_norm_eps)
            self.k_layernorm = LayerNorm(head, config.layer_norm_eps)
        self.attn = Attention(
            backend,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=head,
            scale=head**-0.5,
        )

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.reshape(n, self.num_heads, self.head_size)
        k = k.reshape(n, self.num_kv_heads, self.head_size)
        if self.q_layernorm is not None and self.k_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q.reshape(n, -1), k.reshape(n, -1), v, kv_cache, meta)
        return self.dense(out)


class PhiMLP(nn.Module):
    def __init__(self, config: Any, *, tp: TPContext) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(
            config.hidden_size, [config.intermediate_size], bias=True, tp=tp
        )
        self.fc2 = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=True, tp=tp)
        self.act = get_act_fn(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class PhiDecoderLayer(nn.Module):
    def __init__(
        self, config: Any, backend: AttentionBackend, rotary: RotaryEmbedding, *, tp: TPContext
    ) -> None:
        super().__init__()
        self.input_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.self_attn = PhiAttention(config, backend, rotary, tp=tp)
        self.mlp = PhiMLP(config, tp=tp)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: None,  # Phi adds the residual inside the layer
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, None]:
        normed = self.input_layernorm(hidden)
        attn = self.self_attn(positions, normed, kv_cache, meta)
        return attn + self.mlp(normed) + hidden, None  # transformers' summation order


class PhiForCausalLM(CausalLM):
    carries_residual = False
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(
        self,
        config: Any,
        *,
        attn_backend: AttentionBackend,
        tp: TPContext = SINGLE,
        pp: PPContext = WHOLE_MODEL,
        max_position: int | None = None,
    ) -> None:
        if getattr(config, "tie_word_embeddings", False):
            raise ValueError("tie_word_embeddings: Phi with a tied LM head is not supported")
        super().__init__(config, tp=tp, pp=pp)
        head = head_size_of(config)
        rotary_dim = int(head * rope_partial_factor(config))
        max_pos = max_position or config.max_position_embeddings
        self.rotary = RotaryEmbedding(config, head, rotary_dim, max_pos)
        self.embed_tokens: VocabParallelEmbedding | None = None
        if pp.is_first:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = self.stage_layers(
            lambda i: PhiDecoderLayer(config, attn_backend, self.rotary, tp=tp)
        )
        self.final_layernorm: LayerNorm | None = None
        self.lm_head: BiasedLMHead | None = None
        if pp.is_last:
            self.final_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps)
            self.lm_head = BiasedLMHead(config.vocab_size, config.hidden_size, tp=tp)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None  # the first pipeline stage's
        return self.embed_tokens(input_ids)

    def finish(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        assert self.final_layernorm is not None
        return self.final_layernorm(hidden)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3: Llama's layers (partial rotary included); only the checkpoint layout differs."""

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        config = self.config
        head = head_size_of(config)
        num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        q_size, kv_size = config.num_attention_heads * head, num_kv * head
        splits = {
            "qkv_proj": (("q_proj", "k_proj", "v_proj"), [q_size, kv_size, kv_size]),
            "gate_up_proj": (("gate_proj", "up_proj"), [config.intermediate_size] * 2),
        }
        return split_fused(weights, splits)


def split_fused(
    weights: Iterable[tuple[str, torch.Tensor]],
    splits: dict[str, tuple[tuple[str, ...], list[int]]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Undo a checkpoint's fusion (``qkv_proj`` -> ``q_proj``, ``k_proj``, ``v_proj``).

    The parts are fused again by the model's own mapper, which shards each part separately: a
    fused tensor cut into equal rank slices would mix q, k and v rows under tensor parallelism.
    """
    for name, tensor in weights:
        parts = name.split(".")
        fused = parts[-2] if len(parts) >= 2 else ""
        if fused not in splits:
            yield name, tensor
            continue
        names, sizes = splits[fused]
        if tensor.shape[0] != sum(sizes):
            raise CheckpointError(f"{name}: {tensor.shape[0]} rows, expected {sizes} summed")
        for part, piece in zip(names, tensor.split(sizes, dim=0), strict=True):
            parts[-2] = part
            yield ".".join(parts), piece

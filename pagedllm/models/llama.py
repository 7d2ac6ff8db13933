"""The Llama family: Llama, Mistral and Qwen2 (RoPE, GQA, RMSNorm, SiLU-gated MLP).

Differences inside the family come from the config: ``attention_bias`` (Qwen2 always has q/k/v
bias), ``head_dim``, rope scaling, ``sliding_window`` and ``tie_word_embeddings``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.backends.base import AttentionBackend, AttentionMetadata
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention import Attention
from pagedllm.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.parallel import SINGLE, WHOLE_MODEL, PPContext, TPContext
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.causal_lm import QKV_GATE_UP_FUSED, CausalLM


def head_size_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config: Any, layer_idx: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types and layer_types[layer_idx] != "sliding_attention":
        # Qwen2-style configs say per layer; Mistral's has no layer_types and slides everywhere.
        return None
    return int(window)


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hidden: int,
        intermediate: int,
        *,
        bias: bool,
        tp: TPContext,
        act: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate] * 2, bias=bias, tp=tp)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias, tp=tp)
        self.act = act or SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        *,
        qkv_bias: bool,
        tp: TPContext,
    ) -> None:
        super().__init__()
        head = head_size_of(config)
        num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head, config.num_attention_heads, num_kv, bias=qkv_bias, tp=tp
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head,
            config.hidden_size,
            bias=bool(getattr(config, "attention_bias", False)) and not qkv_bias_only(config),
            tp=tp,
        )
        self.rotary = rotary
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_size = head
        self.heads_split = [self.num_heads, self.num_kv_heads, self.num_kv_heads]
        self.attn = Attention(
            backend,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=head,
            scale=self.attention_scale(config),
            sliding_window=sliding_window_of(config, layer_idx),
            logits_soft_cap=self.logits_soft_cap(config),
        )

    def attention_scale(self, config: Any) -> float:
        """The softmax scale (Gemma 2 takes it from ``query_pre_attn_scalar``)."""
        return self.head_size**-0.5

    def logits_soft_cap(self, config: Any) -> float | None:
        """A cap on the attention scores (Gemma 2), or None."""
        return None

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [num_tokens, (heads + 2 * kv_heads) * head_size]
        # q, k and v as per-head views of the fused output: one reshape and one split, where
        # splitting first and viewing each part cost four more tensor calls per layer.
        q, k, v = qkv.reshape(qkv.shape[0], -1, self.head_size).split_with_sizes(
            self.heads_split, 1
        )
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


def qkv_bias_only(config: Any) -> bool:
    """Qwen2 has q/k/v biases but no o_proj bias, whatever ``attention_bias`` says."""
    return getattr(config, "model_type", "") == "qwen2"


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        tp: TPContext,
        model: LlamaForCausalLM,
    ) -> None:
        super().__init__()
        qkv_bias = qkv_bias_only(config) or bool(getattr(config, "attention_bias", False))
        self.self_attn = model.attention_cls(
            config, layer_idx, backend, rotary, qkv_bias=qkv_bias, tp=tp
        )
        self.mlp = model.make_mlp(config, layer_idx, tp)
        eps, offset = config.rms_norm_eps, model.norm_offset
        self.input_layernorm = RMSNorm(config.hidden_size, eps, offset=offset)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, offset=offset)

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
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(CausalLM):
    """Also serves ``MistralForCausalLM`` and ``Qwen2ForCausalLM`` checkpoints.

    Close relatives (Qwen3, Gemma) subclass it and change only the hooks below.
    """

    attention_cls: type[LlamaAttention] = LlamaAttention
    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    norm_offset = 0.0  # Gemma's RMSNorm scales by (1 + weight)
    fused_weights = QKV_GATE_UP_FUSED
    ignored_weights = ("rotary_emb.inv_freq",)

    def make_act(self, config: Any) -> nn.Module:
        return SiluAndMul()

    def make_mlp(self, config: Any, layer_idx: int, tp: TPContext) -> nn.Module:
        """The feed-forward part of layer ``layer_idx`` (mixture-of-experts models override it)."""
        return LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            bias=bool(getattr(config, "mlp_bias", False)),
            tp=tp,
            act=self.make_act(config),
        )

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None  # the first pipeline stage's
        return self.embed_tokens(input_ids)

    def finish(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        assert self.norm is not None
        hidden, _ = self.norm(hidden, residual)
        return hidden

    # Gemma 3 keys rope_parameters by layer type: one table per type, each layer takes its own.
    rope_per_layer_type = False

    def __init__(
        self,
        config: Any,
        *,
        attn_backend: AttentionBackend,
        tp: TPContext = SINGLE,
        pp: PPContext = WHOLE_MODEL,
        max_position: int | None = None,
    ) -> None:
        super().__init__(config, tp=tp, pp=pp)
        head = head_size_of(config)
        rotary_dim = int(head * rope_partial_factor(config))
        max_pos = max_position or config.max_position_embeddings
        if self.rope_per_layer_type:
            self.rotaries = nn.ModuleDict(
                {
                    kind: RotaryEmbedding(config, head, rotary_dim, max_pos, layer_type=kind)
                    for kind in sorted(set(config.layer_types))
                }
            )
        else:
            self.rotary = RotaryEmbedding(config, head, rotary_dim, max_pos)
        self.embed_tokens: VocabParallelEmbedding | None = None
        if self.holds_embedding:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = self.stage_layers(
            lambda i: self.decoder_layer_cls(config, i, attn_backend, self._rotary_of(i), tp, self)
        )
        self.norm: RMSNorm | None = None
        self.lm_head: VocabParallelEmbedding | None = None
        if pp.is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=self.norm_offset)
            self.lm_head = self.make_lm_head(self.embed_tokens, config.hidden_size)

    def decode_stack_ends(self) -> tuple[nn.Module, nn.Module, nn.Module] | None:
        """(embedding, final norm, LM head) where this model's ends are the plain ones a
        backend's decode stack reproduces from token ids to logits (``fast_decode_logits``):
        a look-up, the final RMSNorm, the head's logits. None where the layers are not plain
        (:meth:`decode_stack_layers`) or a relative changes an end (Gemma scales the embedding,
        Gemma 2 caps the logits)."""
        cls = type(self)
        plain = (
            cls.embed is LlamaForCausalLM.embed
            and cls.finish is LlamaForCausalLM.finish
            and cls.compute_logits is CausalLM.compute_logits
            and self.embed_tokens is not None
            and self.norm is not None
            and getattr(self, "lm_head", None) is not None
        )
        if not plain or self.decode_stack_layers() is None:
            return None
        return self.embed_tokens, self.norm, self.lm_head

    def decode_stack_layers(self) -> list[LlamaDecoderLayer] | None:
        """The layers, where this model is the plain Llama shape a backend's decode stack runs
        (``fast_decode``): RMSNorm without Gemma's offset, the attention without q/k norms or a
        score cap, the SiLU-gated MLP, one rotary table, the whole model on one rank. None for
        any relative that changes a layer (Qwen3, Gemma, mixture-of-experts), so a stack never
        runs a layer it does not reproduce."""
        cls = type(self)
        plain = (
            cls.attention_cls is LlamaAttention
            and cls.decoder_layer_cls is LlamaDecoderLayer
            and self.norm_offset == 0.0
            and not self.rope_per_layer_type
            and self.tp.size == 1
            and self.pp.size == 1
        )
        if not plain:
            return None
        layers = list(self.layers)
        for layer in layers:
            mlp, attn = layer.mlp, layer.self_attn
            if type(layer) is not LlamaDecoderLayer or type(attn) is not LlamaAttention:
                return None
            if type(mlp) is not LlamaMLP or type(mlp.act) is not SiluAndMul or attn.attn.extra:
                return None
        return layers

    def _rotary_of(self, layer_idx: int) -> RotaryEmbedding:
        if self.rope_per_layer_type:
            return self.rotaries[self.config.layer_types[layer_idx]]  # type: ignore[return-value]
        return self.rotary


def rope_partial_factor(config: Any) -> float:
    from pagedllm.layers.rotary import rope_parameters

    factor = rope_parameters(config).get("partial_rotary_factor")
    return float(factor or getattr(config, "partial_rotary_factor", 1.0) or 1.0)

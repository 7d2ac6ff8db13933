"""BERT, RoBERTa and XLM-RoBERTa encoders: embedders and sequence classifiers (cross-encoders).

An encoder reads each whole input at once with bidirectional attention and keeps no KV cache
(:class:`~pagedllm.layers.encoder_attention.EncoderAttention`), so ``uses_kv_cache`` is False and
the engine must give it every prompt whole, in one step, at positions ``0 .. len-1`` (see
``models/pooling.py`` for the contract). Post-LayerNorm blocks: attention, add, LayerNorm; GELU
MLP, add, LayerNorm. RoBERTa and XLM-R are BERT with learned positions offset by
``pad_token_id + 1`` (fairseq's legacy: position ``p`` reads row ``p + pad + 1``, as transformers
numbers a sequence without padding) and a classification head of their own.

Rotary encoders (nomic-bert, read from llama.cpp's GGUF files: ``models/gguf/encoder.py``) are
the same blocks with ``position_embedding_type`` "rotary" (no position table; q and k rotated,
rotate-half, at ``rope_theta``), a SwiGLU MLP (``gated_mlp``: fused gate and up) and biases as the
config says (``attention_bias``, ``mlp_bias``; a Hugging Face BERT config has neither: True).

Checkpoints name the encoder ``bert.``/``roberta.`` (classifiers, pre-training heads) or with no
prefix (``BertModel`` as sentence-transformers saves it); both load.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from pagedllm.backends.base import AttentionMetadata
from pagedllm.layers.activation import SiluAndMul, get_act_fn
from pagedllm.layers.encoder_attention import EncoderAttention
from pagedllm.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedllm.layers.norm import LayerNorm
from pagedllm.layers.parallel import SINGLE, WHOLE_MODEL, PPContext, TPContext
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.checkpoint import WeightMapper, load_mapped_weights
from pagedllm.models.pooling import PoolingConfig, PoolingType, pool_hidden


def check_encoder_config(config: Any, tp: TPContext, pp: PPContext) -> None:
    """Refuse, by field name, what this encoder does not compute."""
    kind = getattr(config, "position_embedding_type", "absolute") or "absolute"
    if kind not in ("absolute", "rotary"):
        raise ValueError(
            f"position_embedding_type: {kind!r} is not supported (only 'absolute' and 'rotary')"
        )
    for field in ("is_decoder", "add_cross_attention"):
        if getattr(config, field, False):
            raise ValueError(f"{field}: an encoder used as a decoder is not supported")
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(
            f"num_attention_heads: {config.num_attention_heads} does not divide "
            f"hidden_size {config.hidden_size}"
        )
    if tp.size > 1 or pp.size > 1:
        raise ValueError(
            "tensor_parallel_size / pipeline_parallel_size: encoder models run on one device"
        )


def is_rotary(config: Any) -> bool:
    return getattr(config, "position_embedding_type", "absolute") == "rotary"


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any, position_offset: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.position_offset = position_offset
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, hidden)
        self.position_embeddings = (
            None
            if is_rotary(config)  # positions enter as the rotation of q and k
            else VocabParallelEmbedding(config.max_position_embeddings, hidden)
        )
        self.token_type_embeddings = VocabParallelEmbedding(max(config.type_vocab_size, 1), hidden)
        self.LayerNorm = LayerNorm(hidden, config.layer_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens], 0 .. len-1 per sequence
        token_type_ids: torch.Tensor | None,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        hidden = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            hidden = hidden + self.position_embeddings(positions + self.position_offset)
        if token_type_ids is None:  # every token of type 0: one row, broadcast
            hidden = hidden + self.token_type_embeddings.weight[0]
        else:
            hidden = hidden + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(hidden)


class BertSelfAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        head_size = hidden // heads
        self.heads, self.head_size = heads, head_size
        bias = getattr(config, "attention_bias", True)
        self.qkv_proj = QKVParallelLinear(hidden, head_size, heads, heads, bias=bias)
        self.attn = EncoderAttention(num_heads=heads, head_size=head_size, scale=head_size**-0.5)
        self.rotary = (
            RotaryEmbedding(config, head_size, head_size, config.max_position_embeddings)
            if is_rotary(config)
            else None
        )

    def forward(
        self, hidden: torch.Tensor, meta: AttentionMetadata, positions: torch.Tensor
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        if self.rotary is not None:
            shape = (q.shape[0], self.heads, self.head_size)
            q, k = self.rotary(positions, q.reshape(shape), k.reshape(shape))
            q, k = q.reshape(v.shape), k.reshape(v.shape)
        return self.attn(q, k, v, meta)


class OneDeviceRowLinear(RowParallelLinear):
    """A row-parallel layer that never is split (encoders refuse tensor parallelism), so its
    bias rides in the backend's GEMM instead of a pass of its own over the output (~5% of a
    MiniLM forward on the CPU)."""

    fast_linear_has_bias = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast_linear is not None:  # bias included
            return self.fast_linear(x)
        return super().forward(x)


class DenseNorm(nn.Module):
    """``LayerNorm(dense(x) + residual)``: how BERT's blocks close (transformers' ``*Output``)."""

    def __init__(self, input_size: int, hidden: int, eps: float, bias: bool = True) -> None:
        super().__init__()
        self.dense = OneDeviceRowLinear(input_size, hidden, bias=bias)
        self.LayerNorm = LayerNorm(hidden, eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.self_attn = BertSelfAttention(config)
        bias = getattr(config, "attention_bias", True)
        self.output = DenseNorm(config.hidden_size, config.hidden_size, config.layer_norm_eps, bias)


class BertIntermediate(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        width, bias = config.intermediate_size, getattr(config, "mlp_bias", True)
        gated = getattr(config, "gated_mlp", False)  # SwiGLU: [gate | up], silu(gate) * up
        sizes = [width, width] if gated else [width]
        self.dense = ColumnParallelLinear(config.hidden_size, sizes, bias=bias)
        self.act = SiluAndMul() if gated else get_act_fn(config.hidden_act)


class BertLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        eps, bias = config.layer_norm_eps, getattr(config, "mlp_bias", True)
        self.output = DenseNorm(config.intermediate_size, config.hidden_size, eps, bias)

    def forward(
        self, hidden: torch.Tensor, meta: AttentionMetadata, positions: torch.Tensor
    ) -> torch.Tensor:
        attn = self.attention
        hidden = attn.output(attn.self_attn(hidden, meta, positions), hidden)
        inter = self.intermediate.act(self.intermediate.dense(hidden))
        return self.output(inter, hidden)


class BertEncoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertModel(nn.Module):
    """The encoder as an embedder: hidden states, pooled as the checkpoint's folder says (mean,
    as sentence-transformers pools a plain transformers folder, when it says nothing)."""

    task: ClassVar[str] = "embed"
    uses_kv_cache: ClassVar[bool] = False
    position_offset_from_pad: ClassVar[bool] = False  # RoBERTa's positions start at pad + 1
    checkpoint_prefixes: ClassVar[tuple[str, ...]] = ("bert.",)
    # Heads an embedder does not run: the pooler (a classifier's), pre-training and MLM heads,
    # and the position-id buffer older checkpoints saved.
    ignored_weights: ClassVar[tuple[str, ...]] = ("pooler.", "cls.", "lm_head.", "position_ids")

    def __init__(
        self,
        config: Any,
        *,
        attn_backend: Any = None,  # unused: encoders attend through EncoderAttention
        tp: TPContext = SINGLE,
        pp: PPContext = WHOLE_MODEL,
    ) -> None:
        super().__init__()
        check_encoder_config(config, tp, pp)
        self.config = config
        offset = config.pad_token_id + 1 if self.position_offset_from_pad else 0
        #: The longest input the position table holds.
        self.max_positions = config.max_position_embeddings - offset
        self.embeddings = BertEmbeddings(config, offset)
        self.encoder = BertEncoder(config)
        self.pooling_config = PoolingConfig(PoolingType.MEAN, normalize=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # unused: no cache
        attn_meta: AttentionMetadata,
        token_type_ids: torch.Tensor | None = None,  # [num_tokens]
    ) -> torch.Tensor:  # [num_tokens, hidden]
        hidden = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            hidden = layer(hidden, attn_meta, positions)
        return hidden

    def pool(self, hidden: torch.Tensor, query_lens: list[int]) -> torch.Tensor:
        """``[num_seqs, hidden]`` float32, neither truncated nor normalised yet."""
        return pool_hidden(hidden, query_lens, self.pooling_config.pooling_type)

    def weight_mapper(self) -> WeightMapper:
        return WeightMapper(
            strip_prefixes=self.checkpoint_prefixes,
            fused={
                "query": ("qkv_proj", 0),
                "key": ("qkv_proj", 1),
                "value": ("qkv_proj", 2),
                "gate": ("dense", 0),  # a gated MLP's halves (GGUF nomic-bert files)
                "up": ("dense", 1),
            },
            renames={".attention.self.": ".attention.self_attn."},
            ignore=self.ignored_weights,
        )

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return load_mapped_weights(self, weights, self.weight_mapper())


class RobertaModel(BertModel):
    position_offset_from_pad = True
    checkpoint_prefixes = ("roberta.",)


def first_tokens(hidden: torch.Tensor, query_lens: list[int]) -> torch.Tensor:
    """The first token's row of each sequence (BERT's [CLS], RoBERTa's <s>)."""
    return hidden[pool_index(query_lens, hidden.device)]


def pool_index(query_lens: list[int], device: torch.device) -> torch.Tensor:
    lens = torch.tensor(query_lens, device=device)
    return torch.cumsum(lens, 0) - lens


class BertForSequenceClassification(BertModel):
    """A cross-encoder: the pooler (dense + tanh on [CLS]) then a linear classifier; ``pool``
    answers the logits ``[num_seqs, num_labels]`` in float32. A GGUF rank file without
    llama.cpp's ``cls`` tensor has no pooler (``classifier_pooler`` False, our own config field):
    its classifier reads [CLS] as it is, as llama.cpp computes such a file."""

    task = "classify"
    ignored_weights = ("cls.", "lm_head.", "position_ids")

    def __init__(self, config: Any, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        hidden = config.hidden_size
        self.pooling_config = PoolingConfig(PoolingType.CLS, normalize=False)
        self.pooler: nn.Module | None = None
        if getattr(config, "classifier_pooler", True):
            self.pooler = nn.Module()
            self.pooler.dense = ColumnParallelLinear(hidden, [hidden], bias=True)
        self.classifier = ColumnParallelLinear(hidden, [config.num_labels], bias=True)

    def pool(self, hidden: torch.Tensor, query_lens: list[int]) -> torch.Tensor:
        pooled = first_tokens(hidden, query_lens)
        if self.pooler is not None:
            pooled = torch.tanh(self.pooler.dense(pooled))
        return self.classifier(pooled).float()


class RobertaForSequenceClassification(RobertaModel):
    """RoBERTa's head: dense + tanh + out_proj on the <s> token (no pooler)."""

    task = "classify"
    ignored_weights = ("lm_head.", "position_ids", "pooler.")

    def __init__(self, config: Any, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        hidden = config.hidden_size
        self.pooling_config = PoolingConfig(PoolingType.CLS, normalize=False)
        self.classifier = nn.Module()
        self.classifier.dense = ColumnParallelLinear(hidden, [hidden], bias=True)
        self.classifier.out_proj = ColumnParallelLinear(hidden, [config.num_labels], bias=True)

    def pool(self, hidden: torch.Tensor, query_lens: list[int]) -> torch.Tensor:
        head = self.classifier
        return head.out_proj(torch.tanh(head.dense(first_tokens(hidden, query_lens)))).float()

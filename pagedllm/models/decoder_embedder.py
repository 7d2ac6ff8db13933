"""Decoder-only embedders (Qwen3-Embedding, gte-Qwen2 style): a generative family's decoder
without its head, whose final hidden state pooled (the last token's, by default) is the
embedding.

Unlike the encoders, these run causally on the paged KV cache exactly as their generative
family does (``uses_kv_cache`` is True), so the scheduler may chunk their prompts and their
shared prefixes hit the prefix cache: the last token's hidden state is computed in the step that
computes the last chunk. Mean pooling over such a model needs every token's state in one step
(no cache hits, no chunking); last-token pooling needs only that final step.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from pagedllm.backends.base import AttentionMetadata
from pagedllm.layers.parallel import SINGLE, WHOLE_MODEL, PPContext, TPContext
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.pooling import PoolingConfig, PoolingType, pool_hidden
from pagedllm.models.qwen3 import Qwen3ForCausalLM


class DecoderEmbedder:
    """Mixed in before a :class:`~pagedllm.models.causal_lm.CausalLM` family."""

    task: ClassVar[str] = "embed"
    uses_kv_cache: ClassVar[bool] = True
    # A checkpoint saved from the bare decoder (``Qwen3Model``) has no ``model.`` prefix and no
    # head; one saved from ``...ForCausalLM`` has both: its head is not read.
    ignored_weights: ClassVar[tuple[str, ...]] = ("lm_head.", *LlamaForCausalLM.ignored_weights)

    def __init__(
        self,
        config: Any,
        *,
        attn_backend: Any,
        tp: TPContext = SINGLE,
        pp: PPContext = WHOLE_MODEL,
        **kwargs: Any,
    ) -> None:
        if pp.size > 1:
            raise ValueError("pipeline_parallel_size: embedding models run as one stage")
        super().__init__(config, attn_backend=attn_backend, tp=tp, pp=pp, **kwargs)  # type: ignore[call-arg]
        self.lm_head = None  # no logits: the head (tied or not) is neither held nor packed
        self.pooling_config = PoolingConfig(PoolingType.LAST, normalize=True)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],
        attn_meta: AttentionMetadata,
        token_type_ids: torch.Tensor | None = None,  # no token types in a decoder
    ) -> torch.Tensor:  # [num_tokens, hidden], after the final norm
        return super().forward(input_ids, positions, kv_caches, attn_meta)  # type: ignore[misc]

    def pool(self, hidden: torch.Tensor, query_lens: list[int]) -> torch.Tensor:
        """``[num_seqs, hidden]`` float32 over this step's tokens of each sequence."""
        return pool_hidden(hidden, query_lens, self.pooling_config.pooling_type)


class LlamaEmbeddingModel(DecoderEmbedder, LlamaForCausalLM):
    """Llama, Mistral and Qwen2 decoders as embedders (gte-Qwen2)."""


class Qwen3EmbeddingModel(DecoderEmbedder, Qwen3ForCausalLM):
    """Qwen3 as an embedder (Qwen3-Embedding)."""

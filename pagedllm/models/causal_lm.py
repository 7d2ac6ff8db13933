"""What every decoder-only family shares: the layer loop, the pipeline stage and the weight map.

A family builds its modules (only its stage's layers, through :meth:`CausalLM.stage_layers`;
the first stage's embedding, the last stage's final norm and head) and says how to embed and
how to finish; the base runs the layers of its stage, hands the next stage the activations,
and loads only the checkpoint tensors its stage holds. So a family runs pipeline stages by
inheritance, whatever its layers look like.

Every decoder layer is called ``layer(positions, hidden, residual, kv_cache, meta)`` and
returns ``(hidden, residual)``. Families that carry the residual stream outside the layer (the
Llama family: the add is fused into the norm that starts the next layer) pass it along; families
whose layers add it themselves (OPT, GPT-2, Phi) return None for it.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from pagedllm.backends.base import AttentionMetadata
from pagedllm.layers.linear import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.parallel import SINGLE, WHOLE_MODEL, PPContext, TPContext
from pagedllm.models.checkpoint import WeightMapper, load_mapped_weights

# What one pipeline stage hands the next: the decoder's (hidden, residual), [num_tokens, hidden].
Intermediate = tuple[torch.Tensor, torch.Tensor]
FastDecodeFn = Callable[
    [torch.Tensor, torch.Tensor, list[torch.Tensor], AttentionMetadata], Intermediate | None
]
# A decode step's logits [num_seqs, vocab], and where asked each row's first maximum and its
# log-probability (the sampler's greedy answer; empty lists otherwise).
DecodeLogits = tuple[torch.Tensor, list[int], list[float]]
# (token_ids, positions, block_tables, block_size, kv_caches, greedy): sequence i computes
# token_ids[i] at positions[i] over its block table; the backend builds its own index tensors.
DecodeLogitsFn = Callable[
    [list[int], list[int], list[list[int]], int, list[torch.Tensor], bool], DecodeLogits | None
]

# Checkpoints store q, k, v (and gate, up) apart; the model holds each group as one projection.
QKV_FUSED: Mapping[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
}
GATE_UP_FUSED: Mapping[str, tuple[str, int]] = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
QKV_GATE_UP_FUSED: Mapping[str, tuple[str, int]] = {**QKV_FUSED, **GATE_UP_FUSED}


class AbsentLayer(nn.Module):
    """A decoder layer another pipeline stage holds: no parameters here, never called. Keeps the
    layer list indexed as the checkpoint numbers it."""


class CausalLM(nn.Module):
    """A decoder-only language model, whole or one pipeline stage of it (``pp``).

    Subclasses build their modules after ``super().__init__`` and implement :meth:`embed`,
    :meth:`finish` and :meth:`compute_logits`; a module another stage holds is None, which is
    also how :meth:`stage_weights` knows to drop its tensors.
    """

    # The attribute (and checkpoint name) of the decoder layer list: GPT-2 calls it "h".
    layers_name: ClassVar[str] = "layers"
    # The input embedding, which a tied LM head shares.
    embedding_name: ClassVar[str] = "embed_tokens"
    # Whether the head is tied when the config does not say (OPT and GPT-2 tie by default).
    tied_default: ClassVar[bool] = False
    # Whether layers hand on a residual (see the module docstring).
    carries_residual: ClassVar[bool] = True
    # The checkpoint's names -> the model's (see :class:`~pagedllm.models.checkpoint.WeightMapper`).
    checkpoint_prefixes: ClassVar[tuple[str, ...]] = ("model.",)
    fused_weights: ClassVar[Mapping[str, tuple[str, int]]] = QKV_FUSED
    weight_renames: ClassVar[Mapping[str, str]] = {}
    ignored_weights: ClassVar[tuple[str, ...]] = ()
    mapper_cls: ClassVar[type[WeightMapper]] = WeightMapper
    #: A backend's whole-stack decode step (``prepare_model``: the CPU's C++ stack for a family
    #: that offers ``decode_stack_layers``, CUDA graphs of :meth:`run_layers` for any family):
    #: ``(hidden, positions, kv_caches, meta)`` -> the last layer's ``(hidden, residual)``
    #: (residual None for families that carry none), or None where it cannot take the step
    #: (the layer loop runs then).
    fast_decode: FastDecodeFn | None = None
    #: A backend's whole decode step from the scheduler's lists to logits, the ends included
    #: (the CPU's stack where the embedding, final norm and head are plain too), with the
    #: greedy rows' tokens where asked (``DecodeLogitsFn``), or None where it cannot take the
    #: step. The runner calls it (:meth:`decode_logits`) for decode-only steps whose every
    #: token is sampled once; :meth:`forward` and :meth:`compute_logits` otherwise. It is
    #: called outside torch's inference mode and takes it itself (the C++ stack's guard).
    fast_decode_logits: DecodeLogitsFn | None = None

    def __init__(self, config: Any, *, tp: TPContext = SINGLE, pp: PPContext = WHOLE_MODEL) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.pp = pp
        self.start_layer, self.end_layer = pp.layer_range(config.num_hidden_layers)
        self.tied = bool(getattr(config, "tie_word_embeddings", self.tied_default))
        self._layer_index = re.compile(rf"(?:^|\.){re.escape(self.layers_name)}\.(\d+)\.")

    # -- building ------------------------------------------------------------------------------
    @property
    def holds_embedding(self) -> bool:
        """The first stage embeds; a tied head on the last stage reads the same table."""
        return self.pp.is_first or (self.pp.is_last and self.tied)

    def stage_layers(self, build: Callable[[int], nn.Module]) -> nn.ModuleList:
        """Layer ``i`` built by ``build(i)`` on the stage that runs it, else an AbsentLayer."""
        return nn.ModuleList(
            build(i) if self.start_layer <= i < self.end_layer else AbsentLayer()
            for i in range(self.config.num_hidden_layers)
        )

    def make_lm_head(
        self, embedding: VocabParallelEmbedding | None, width: int
    ) -> VocabParallelEmbedding:
        """The last stage's head: the embedding itself when tied, else its own table."""
        if self.tied:
            assert embedding is not None, "a tied head needs the embedding on the last stage"
            return embedding
        return ParallelLMHead(self.config.vocab_size, width, tp=self.tp)

    # -- running -------------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The first stage's input to layer 0, [num_tokens, hidden]."""
        raise NotImplementedError

    def finish(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The last stage's output after its last layer: the final norm (and projection)."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab]
        lm_head = getattr(self, "lm_head", None)
        assert lm_head is not None, "logits are the last pipeline stage's"
        return lm_head.logits(hidden)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # this stage's layers only
        meta: AttentionMetadata,
        intermediate: Intermediate | None = None,  # from the stage before (not on the first)
    ) -> torch.Tensor | Intermediate:  # [num_tokens, hidden], or what the next stage needs
        residual: torch.Tensor | None
        if self.pp.is_first:
            hidden, residual = self.embed(input_ids, positions), None
        else:
            assert intermediate is not None, "a later pipeline stage needs the activations"
            hidden, residual = intermediate
            if not self.carries_residual:
                residual = None  # the zeros the stage before sent in its place
        fast = self.fast_decode
        # Decode-only steps (one query token per sequence) of the whole model; every other step,
        # and any the backend's stack declines, runs the layers one by one below.
        if fast is not None and residual is None and meta.max_query_len == 1:
            done = fast(hidden, positions, kv_caches, meta)
            if done is not None:
                return self.finish(*done)
        hidden, residual = self.run_layers(positions, hidden, residual, kv_caches, meta)
        if not self.pp.is_last:
            # The link between stages always carries two tensors of one shape.
            return hidden, residual if residual is not None else torch.zeros_like(hidden)
        return self.finish(hidden, residual)

    def decode_logits(
        self,
        token_ids: list[int],  # one token per sequence
        positions: list[int],
        block_tables: list[list[int]],
        block_size: int,
        kv_caches: list[torch.Tensor],
        *,
        greedy: bool = False,
    ) -> DecodeLogits | None:
        """A decode-only step's logits in one backend call (``fast_decode_logits``), with each
        row's first maximum and its log-probability where ``greedy``; or None: the caller runs
        :meth:`forward`, :meth:`compute_logits` and the sampler, which give the same."""
        fast = self.fast_decode_logits
        if fast is None or not self.pp.is_first or not self.pp.is_last:
            return None
        return fast(token_ids, positions, block_tables, block_size, kv_caches, greedy)

    def run_layers(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This stage's layers one by one: the reference path, and what a backend that replays
        a captured step (CUDA graphs) records."""
        # (islice: slicing a ModuleList would build a new module on every step)
        layers = itertools.islice(getattr(self, self.layers_name), self.start_layer, self.end_layer)
        for layer, cache in zip(layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, cache, meta)
        return hidden, residual

    # -- loading -------------------------------------------------------------------------------
    def stage_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint tensors this pipeline stage holds; the others are dropped unread (under
        pipeline parallelism the loader hands out lazy tensors, read on use)."""
        for name, tensor in weights:
            if self.pp.size == 1 or self._holds(name):
                yield name, tensor

    def _holds(self, name: str) -> bool:
        match = self._layer_index.search(name)
        if match is not None:
            return self.start_layer <= int(match.group(1)) < self.end_layer
        for prefix in self.checkpoint_prefixes:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        # A top-level module another stage holds is None here; unknown names are the loader's.
        return getattr(self, name.split(".")[0], True) is not None

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """The stage's checkpoint tensors as the mapper expects them (transposes, splits)."""
        return weights

    def weight_mapper(self) -> WeightMapper:
        return self.mapper_cls(
            strip_prefixes=self.checkpoint_prefixes,
            fused=dict(self.fused_weights),
            renames=dict(self.weight_renames),
            ignore=self.ignored_weights,
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        embedding = getattr(self, self.embedding_name)
        tied = embedding is not None and getattr(self, "lm_head", None) is embedding
        stage = self.checkpoint_weights(self.stage_weights(weights))
        return load_mapped_weights(self, stage, self.weight_mapper(), skip_lm_head=tied)

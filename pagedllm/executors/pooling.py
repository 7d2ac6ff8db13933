"""The runner's pooling side: a pooling request's hidden states become one vector.

The model pools (``model.pool(hidden, query_lens)``: mean, CLS or last token, or a classifier's
head; see ``models/pooling.py``); what a request asks of that vector (Matryoshka
``dimensions``, normalisation) is applied here per request, since requests with different asks
share one batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pagedllm.core.interfaces import ScheduledSeq
from pagedllm.executors.inputs import FlatBatch
from pagedllm.models.pooling import (
    PoolingType,
    finish_embedding,
    parse_pooling_override,
)


class Pooler:
    """The model's pooling with the ``--pooling`` override applied (None: the checkpoint's)."""

    def __init__(self, model: Any, override: str | None = None) -> None:
        self.model = model
        config = getattr(model, "pooling_config", None)
        if override and config is None:
            raise ValueError("pooling: this model does not pool (it generates text)")
        if override and config is not None:
            # The model pools through its own config, so the override goes there.
            kind = parse_pooling_override(override)
            model.pooling_config = dataclasses.replace(config, pooling_type=kind)

    def facts(self) -> dict[str, Any]:
        """The model's task and pooling defaults, plain values that cross any executor."""
        model = self.model
        config = getattr(model, "pooling_config", None)
        kind = config.pooling_type if config is not None else PoolingType.LAST
        return {
            "task": str(getattr(model, "task", "generate")),
            "uses_kv_cache": bool(getattr(model, "uses_kv_cache", True)),
            "pooling_type": PoolingType(kind).value,
            "normalize": bool(getattr(config, "normalize", True)),
            "num_labels": getattr(model, "num_labels", None),
        }

    def step(
        self, hidden: torch.Tensor, batch: FlatBatch, seqs: list[ScheduledSeq]
    ) -> dict[int, list[float]]:
        """seq_id -> the finished vector of every pooling sequence whose prompt ends now."""
        if not batch.pool_spans:
            return {}
        rows = _pooled_rows(hidden, batch.pool_spans)  # [sum(count), H]
        query_lens = [count for _, _, count in batch.pool_spans]
        pooled = self.model.pool(rows, query_lens)  # [num_seqs, D] float32
        out: dict[int, list[float]] = {}
        for j, (i, _, _) in enumerate(batch.pool_spans):
            params = seqs[i].pooling_params
            assert params is not None
            vec = pooled[j : j + 1].float()
            if params.task == "embed":
                normalize = True if params.normalize is None else params.normalize
                vec = finish_embedding(vec, normalize, params.dimensions)
            out[seqs[i].seq_id] = vec[0].tolist()  # a classifier's logits as the head gives them
        return out


def _pooled_rows(hidden: torch.Tensor, spans: list[tuple[int, int, int]]) -> torch.Tensor:
    """The rows of the pooled sequences, back to back: a view where they already are (an
    encoder's step pools every token; its copy was ~4% of a batch-32 MiniLM step), else
    gathered."""
    first, end = spans[0][1], spans[0][1]
    for _, start, count in spans:
        if start != end:
            return torch.cat([hidden[s : s + n] for _, s, n in spans])
        end = start + count
    return hidden[first:end]

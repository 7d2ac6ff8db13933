"""The runner's pooling side: a pooling request's hidden states become one vector.

The model pools (``model.pool(hidden, query_lens)``: mean, CLS or last token, or a classifier's
head); what a request asks of that vector (Matryoshka ``dimensions``, normalisation) is applied
here per request, since requests with different asks share one batch. A generative decoder asked
to embed (``--task embed`` on a causal LM) has no ``pool``: its last token's final hidden state
is the embedding, as decoder embedders (Qwen3-Embedding, gte-Qwen) pool.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pagedllm.core.interfaces import ScheduledSeq
from pagedllm.executors.inputs import FlatBatch


def finish_vector(vec: torch.Tensor, *, normalize: bool, dimensions: int | None) -> torch.Tensor:
    """Truncate first, then normalise, in float32: a Matryoshka prefix is a unit vector too."""
    vec = vec.float()
    if dimensions is not None:
        vec = vec[..., :dimensions]
    return F.normalize(vec, p=2.0, dim=-1) if normalize else vec


def last_token_pool(hidden: torch.Tensor, query_lens: list[int]) -> torch.Tensor:
    """[T, H] -> [S, H]: each sequence's last row."""
    ends = torch.tensor(query_lens, device=hidden.device).cumsum(0) - 1
    return hidden[ends]


def pool_step(
    model: Any, hidden: torch.Tensor, batch: FlatBatch, seqs: list[ScheduledSeq]
) -> dict[int, list[float]]:
    """seq_id -> the finished vector of every pooling sequence whose prompt ends this step."""
    if not batch.pool_spans:
        return {}
    parts = [hidden[start : start + count] for _, start, count in batch.pool_spans]
    rows = parts[0] if len(parts) == 1 else torch.cat(parts)  # [sum(count), H]
    query_lens = [count for _, _, count in batch.pool_spans]
    pool = getattr(model, "pool", None)
    pooled = pool(rows, query_lens) if pool is not None else last_token_pool(rows, query_lens)
    out: dict[int, list[float]] = {}
    for j, (i, _, _) in enumerate(batch.pool_spans):
        params = seqs[i].pooling_params
        assert params is not None
        if params.task == "embed":
            normalize = True if params.normalize is None else params.normalize
            vec = finish_vector(pooled[j], normalize=normalize, dimensions=params.dimensions)
        else:
            vec = pooled[j].float()  # a classifier's logits, as the checkpoint's head gives them
        out[seqs[i].seq_id] = vec.tolist()
    return out


def pooling_facts(model: Any) -> dict[str, Any]:
    """The model's task and pooling defaults, plain values that cross any executor."""
    config = getattr(model, "pooling_config", None)
    kind = getattr(config, "pooling_type", "last")
    return {
        "task": str(getattr(model, "task", "generate")),
        "uses_kv_cache": bool(getattr(model, "uses_kv_cache", True)),
        "pooling_type": str(getattr(kind, "value", kind)),
        "normalize": bool(getattr(config, "normalize", True)),
        "num_labels": getattr(model, "num_labels", None),
    }

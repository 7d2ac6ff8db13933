"""Per-request pooling parameters: what an embedding or scoring request asks of the model.

A pooling request is prefill-only: it is scheduled like any prompt, and instead of a sampled
token its last prefill step yields one vector (an embedding, or a classifier's logits). These
are checked here, before anything reaches a batch, as ``SamplingParams`` are.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pagedllm.core.sampling_params import SamplingParams

POOLING_TASKS = ("embed", "classify")
MAX_DIMENSIONS = 1 << 20


def _fail(name: str, message: str) -> None:
    raise ValueError(f"{name}: {message}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class PoolingParams:
    """``dimensions``: keep the first N values (Matryoshka truncation), then normalise.
    ``normalize`` None: the model's default (its ``PoolingConfig``). ``truncate_prompt_tokens``:
    keep only N prompt tokens, so a text longer than the model's positions still runs: a
    decoder embedder the last N, an encoder the first ones with its [CLS] ... [SEP] kept
    (``engine/pooling.truncate_prompt``).

    ``whole_prompt`` is the engine's, not the caller's: the model pools over every position
    (mean or CLS pooling), so the prompt is computed whole, in one step, with no prefix-cache
    skip. ``uses_kv_cache`` False (a bidirectional encoder) holds no KV blocks at all; a text
    pair's ``token_type_ids`` come with the prompt and ride here to the model.
    """

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    whole_prompt: bool = False
    uses_kv_cache: bool = True
    # A text pair's segment of each token (BERT's token types), from the prompt; None: all 0.
    token_type_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            _fail("task", f"must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        d = self.dimensions
        if d is not None and (not _is_int(d) or not 1 <= d <= MAX_DIMENSIONS):
            _fail("dimensions", f"must be a positive integer, got {d!r}")
        if d is not None and self.task != "embed":
            _fail("dimensions", "applies only to embeddings")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            _fail("normalize", f"must be true or false, got {self.normalize!r}")
        types = self.token_type_ids
        if types is not None and not all(_is_int(v) and 0 <= v < 16 for v in types):
            _fail("token_type_ids", "must be small non-negative integers (segment ids)")
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or t < 1):
            _fail("truncate_prompt_tokens", f"must be a positive integer, got {t!r}")

    def clone(self, **changes: Any) -> PoolingParams:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return PoolingParams(**values)


# What a request carries: sampling (generation) or pooling (embedding, score) parameters.
RequestParams = SamplingParams | PoolingParams

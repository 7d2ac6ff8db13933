"""Tensor-parallel context: which shard this worker holds, and the collectives that join them.

Passed down explicitly from the worker to every parallel layer (never a module-level global), so
one process can hold several models and the single-worker case costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TPContext:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1
    # Mixture-of-experts layers place whole experts on ranks instead of slicing each expert.
    expert_parallel: bool = False

    def shard(self, total: int, what: str) -> int:
        if total % self.size:
            raise ValueError(
                f"tensor_parallel_size: {what} ({total}) is not divisible by {self.size}"
            )
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TPContext()


def stage_layers(num_layers: int, num_stages: int, stage: int) -> tuple[int, int]:
    """``[start, end)``: the contiguous decoder layers of pipeline stage ``stage``.

    Even shares, and the ``num_layers % num_stages`` extra layers go one each to the earliest
    stages: the last stage also runs the final norm, the LM head and the sampler, so it is the
    one that should not carry more layers than the others.
    """
    if num_stages > num_layers:
        raise ValueError(
            f"pipeline_parallel_size: {num_stages} stages for a model of {num_layers} layers; "
            "every stage needs at least one layer"
        )
    if not 0 <= stage < num_stages:
        raise ValueError(f"pipeline stage {stage} is outside [0, {num_stages})")
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return start, start + base + (1 if stage < extra else 0)


@dataclass(frozen=True)
class PPContext:
    """Which pipeline stage a worker is, and its peers (global ranks) up and down the pipeline.

    The model reads ``stage``/``size`` to build only its layers; the worker's runner sends and
    receives the activations between stages through ``prev_rank`` and ``next_rank``.
    """

    stage: int = 0
    size: int = 1
    prev_rank: int | None = None  # the same TP rank of the stage before (None on the first)
    next_rank: int | None = None  # ... of the stage after (None on the last)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        return stage_layers(num_layers, self.size, self.stage)


WHOLE_MODEL = PPContext()

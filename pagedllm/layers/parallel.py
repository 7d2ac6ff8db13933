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
